"""`ccq-eval inspect`: what the read of a GLA / Gated DeltaNet model does on S-NIAH prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ccq_eval import logs
from ccq_eval.cli.common import Dtype, given_path, path_option
from ccq_eval.cli.errors import fail
from ccq_eval.errors import UserError
from ccq_eval.harness.run_options import DEFAULT_SEED


def inspect(
    model: Annotated[list[str], typer.Option(
        "--model", "-m", metavar="<model>",
        help="GLA / Gated DeltaNet model (registered name or checkpoint folder), with or without "
        "CCQ; repeat for several.")],
    task: Annotated[str, typer.Option("--task", "-t", help=(
        "s-niah-1, s-niah-2, s-niah-3, or a task with distractor needles: niah-multikey-1/2/3, "
        "niah-multivalue, niah-multiquery (the names `run` takes; their lm-eval names ccq_... too)."))]
    = "s-niah-1",
    lengths: Annotated[str, typer.Option(help="Prompt lengths in tokens, e.g. 1k,4k (k = 1024).")] = "1k",
    depths: Annotated[str, typer.Option(help="Needle depths in percent, e.g. 0,50,100.")] = "0,50,100",
    output: Annotated[Path, typer.Option("--output", "-o", parser=path_option, metavar="PATH",
                                         help="Folder for the tables and figures.")]
    = Path("inspect"),
    device: Annotated[str, typer.Option(help="Torch device: auto (CUDA when present), cpu, cuda.")] = "auto",
    dtype: Annotated[Dtype, typer.Option(help="Weights and compute dtype (auto: float32).")] = Dtype.auto,
    positions: Annotated[int, typer.Option(
        help="Positions per prompt sampled for positions.csv (plus the needle's ends and the answer).")] = 64,
    baseline_lambda: Annotated[float | None, typer.Option(
        help="Constant lambda of the CCQ read computed for baselines (default: the gate's initial value, "
        "ccq_lambda_max * sigmoid(ccq_gate_bias_init) = 2 for the default config).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the task's keys and values, as `run --seed` (the same "
                                            "default: a run's prompts unless it was given another).")]
    = DEFAULT_SEED,
    mechanism_figure: Annotated[Path | None, typer.Option(
        help="Also write one small PNG here (e.g. docs/ccq-mechanism.png): the needle share of the read per "
        "layer, CCQ's read against the plain one (lambda = 0), one panel per model.")] = None,
) -> None:
    """What the read does on S-NIAH prompts, per layer and head: the gate lambda_t, the key covariance's
    spectrum, how far CCQ moves the query, and the needle's share of the read with CCQ on and off.

    Writes reads.csv, spectra.csv, positions.csv, inspect.json and figures into --output.
    """
    output = given_path(output)
    logs.hide_progress_bars()  # the command prints its own progress lines; set before transformers loads
    from ccq_eval.harness.options import parse_depths, parse_lengths

    try:
        options_lengths, options_depths = parse_lengths(lengths), parse_depths(depths)
    except UserError as exc:
        fail(str(exc))
    from ccq_eval.inspection.run import InspectOptions, run_inspect

    options = InspectOptions(
        models=list(model), task=task, lengths=options_lengths, depths=options_depths, output=output,
        device=device, dtype="float32" if dtype.value == "auto" else dtype.value, positions=positions,
        baseline_lambda=baseline_lambda, seed=seed, mechanism_figure=mechanism_figure)
    try:
        written = run_inspect(options, progress=lambda message: typer.echo(message, err=True))
    except UserError as exc:
        fail(str(exc))
    typer.echo(f"wrote {len(written)} files into {output}", err=True)
