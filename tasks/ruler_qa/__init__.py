"""RULER QA in lm-eval (hooks: utils.py; data files: data.py; see README.md)."""
