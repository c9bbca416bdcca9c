"""Length-extrapolation perplexity in lm-eval (hooks: utils.py; see README.md)."""
