"""`python cli.py ...` from a checkout: the same as `ccq-eval ...` (the application is ccq_eval.cli).

Not installed; the installed entry points are the `ccq-eval` console script and `python -m ccq_eval`.
"""

from ccq_eval.cli import app

if __name__ == "__main__":
    app()
