"""RULER multi-key / multi-value / multi-query NIAH in lm-eval (hooks: utils.py; see README.md)."""
