"""`ccq-eval inspect`: what the read of a GLA / Gated DeltaNet model (with or without CCQ) does on
S-NIAH prompts.

- prompts.py: S-NIAH prompts with the needle's exact token span (no torch);
- reads.py: capture of each layer's read in one forward pass, the read as a sum over tokens, the
  key covariance (torch);
- measure.py: per layer and head, the gate, the covariance spectrum, the query's move and the
  needle share, as tidy rows (torch);
- run.py: models x prompts -> tables and figures in an output folder;
- figures.py: the figures, from the tables (no torch).
"""

from ccq_eval.errors import UserError


class InspectError(UserError, ValueError):
    """A model, task or prompt `ccq-eval inspect` cannot read; the message says what to use instead."""
