"""Benchmarks: `tandem bench ...`."""
