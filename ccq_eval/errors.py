"""The one base class of errors a user can cause and fix: a bad option, file, checkpoint or results folder.

The command line prints a UserError as its message alone, on one line (the message names what was wrong
and what to do); any other exception is a bug and keeps its type name. Modules raise subclasses of their
own (PlanError, ResultsError, CheckpointError, ...) so that callers can still tell them apart.
Imports nothing: every layer, the model included, may derive from it.
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user caused; its message says what was wrong and what to do."""
