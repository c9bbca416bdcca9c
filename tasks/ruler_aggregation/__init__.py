"""RULER common-words and frequent-words extraction in lm-eval (hooks: utils.py; see README.md)."""
