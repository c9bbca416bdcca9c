"""`python -m ccq_eval ...`: the same as the `ccq-eval` console script."""

from ccq_eval.cli import app

if __name__ == "__main__":
    app(prog_name="ccq-eval")
