"""RULER S-NIAH in lm-eval (hooks: utils.py; see README.md)."""
