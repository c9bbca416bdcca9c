"""RULER variable tracking in lm-eval (hooks: utils.py; see README.md)."""
