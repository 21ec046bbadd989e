"""Benchmarks. Run them from the repository root as modules: `python -m benchmarks.NAME`
(as scripts, `benchmarks/reconfig.py` would hide the `reconfig` package)."""
