"""How the command line reports errors: a user's error (errors.UserError) as its message on one line, any
other exception with its type name; never a traceback unless asked for (CCQ_EVAL_DEBUG=1 or
--verbosity DEBUG)."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
import typer

from ccq_eval.errors import UserError


def debugging() -> bool:
    """CCQ_EVAL_DEBUG=1 or --verbosity DEBUG: unexpected errors show their traceback."""
    return os.environ.get("CCQ_EVAL_DEBUG", "") not in ("", "0") or logging.getLogger("ccq_eval").isEnabledFor(
        logging.DEBUG)


def one_line(exc: BaseException) -> str:
    """An exception as one line: a user's error by its message, others with their type."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}"


def fail(message: str, code: int = 2) -> NoReturn:
    """`Error: MESSAGE` on stderr, then exit with `code` (2: a usage error, as click's own)."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def one_line_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a command so that an exception it does not handle becomes one line on stderr (exit 1), not a
    traceback: a user's error as its message, anything else with its type and a pointer to the traceback
    (shown with CCQ_EVAL_DEBUG=1 or --verbosity DEBUG)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            fail("interrupted; rerun the command to finish (a run resumes where it stopped)", code=130)
        except BrokenPipeError:
            stdout_closed()
        except UserError as exc:  # what was wrong and what to do: the message alone
            fail(one_line(exc), code=1)
        except Exception as exc:  # the point: no traceback for the user
            if debugging():
                raise
            fail(f"{one_line(exc)} (CCQ_EVAL_DEBUG=1 shows the traceback; report it if the cause is unclear)",
                 code=1)

    return wrapper


def stdout_closed() -> NoReturn:
    """The reader of stdout went away (`ccq-eval lm-eval ls | head`): stop quietly, as command-line tools
    do; stdout goes to /dev/null so that Python's last flush does not report the closed pipe either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(1)
