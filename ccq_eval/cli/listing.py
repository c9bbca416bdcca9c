"""`ccq-eval tasks` and `ccq-eval models`: what `run` accepts, with one-line descriptions (no torch)."""

from __future__ import annotations

import typer

from ccq_eval.cli.errors import fail
from ccq_eval.errors import UserError


def tasks() -> None:
    """List the tasks `run --task` accepts, and the suites `run --suite` runs."""
    from ccq_eval.harness import plan as run_plan
    from ccq_eval.harness.suites import SUITES

    try:
        listing = run_plan.default_task_catalog().aliases()
    except UserError as exc:
        fail(str(exc))
    width = max((len(name) for name in listing), default=0)
    for name, description in listing.items():
        typer.echo(f"{name:<{width}}  {description}")
    typer.echo("\nSuites (run --suite NAME):")
    for name, suite in SUITES.items():
        typer.echo(f"{name:<{width}}  {suite.description}")
    typer.echo("\nAny lm-eval task name is accepted as well.", err=True)


def models() -> None:
    """List the registered models `run --model` accepts (checkpoint folders work too)."""
    from ccq_eval.model import registry as model_registry

    try:
        registry = model_registry.load_model_registry()
    except UserError as exc:
        fail(str(exc))
    if not registry:
        fail(f"no models registered in {model_registry.MODEL_REGISTRY_PATH}; pass a checkpoint folder to --model", 1)
    width = max(len(name) for name in registry)
    for entry in registry.values():
        mark = " (default)" if entry.default else ""
        typer.echo(f"{entry.name:<{width}}  {entry.description}{mark}")
