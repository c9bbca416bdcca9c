"""LongBench v1 and LongBench-E in lm-eval (hooks: utils.py, spec.py, metrics.py; see README.md)."""
