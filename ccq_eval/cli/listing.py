"""`ccq-eval tasks` and `ccq-eval models`: what `run` accepts, with one-line descriptions (no torch, except
`models --families`, which reads fla's and transformers' registrations)."""

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


def models(
    families: bool = typer.Option(False, "--families", help="List the model families a checkpoint folder may be "
                                  "(config.json model_type) and the devices each runs on, instead of the models"),
) -> None:
    """List the registered models `run --model` accepts (checkpoint folders work too)."""
    if families:
        _families()
        return
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


def _families() -> None:
    """One line per model type that loads: fla's families (read off the installed fla), ccq-eval's CCQ types,
    and a summary line for transformers' causal LMs."""
    import fla
    import transformers

    from ccq_eval.model.families import ccq_families, fla_families, transformers_causal_lm_types

    rows = [(family.model_type, "ccq-eval", family.devices, "CCQ on the read (on unless the checkpoint says otherwise)")
            for family in ccq_families().values() if family.model_type.startswith("ccq_")]
    for family in fla_families().values():
        note = family.cpu_blocker or ("plain; ccq-eval's CCQ class loads it with ccq off"
                                      if family.model_type in ccq_families() else "")
        rows.append((family.model_type, f"fla {fla.__version__}", family.devices, note))
    width = max(len(row[0]) for row in rows)
    typer.echo(f"{'model_type':<{width}}  {'from':<12}  {'devices':<9}  note")
    for model_type, source, devices, note in sorted(rows):
        typer.echo(f"{model_type:<{width}}  {source:<12}  {devices:<9}  {note}".rstrip())
    causal_lms = transformers_causal_lm_types()
    examples = ", ".join(name for name in ("llama", "qwen2", "mistral") if name in causal_lms)
    typer.echo(f"\nAny transformers {transformers.__version__} causal LM loads too ({len(causal_lms)} model types, "
               f"e.g. {examples}): cpu, cuda.")
