"""Benchmarks, model fetching, head training entry points and device checks; run from the
repository root as modules: python -m scripts.<name>."""
