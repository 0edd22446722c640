"""The dashboard's pages: each module has ``render(url, run_filter)``."""
