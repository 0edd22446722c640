"""Benchmarks (each ``python -m fallbackgate.bench.<name> --json FILE``): ratios measured in one run."""
