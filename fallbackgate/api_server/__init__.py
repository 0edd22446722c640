"""``fallbackgate serve``: an OpenAI-compatible HTTP server over one engine loop, with Prometheus metrics."""
