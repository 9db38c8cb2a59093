"""Benchmarks of fabric-lib (run as modules, e.g. `python -m benchmarks.bench_transfer`)."""
