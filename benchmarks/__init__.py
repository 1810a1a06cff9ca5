"""Benchmarks and paper reproductions; run each as a module from the repository root,
e.g. ``.venv/bin/python -m benchmarks.bench_idc``."""
