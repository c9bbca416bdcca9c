"""`ccq-eval inspect`: models x S-NIAH prompts -> tidy tables and figures in one folder.

One forward pass per (model, prompt) with the read captured (reads.ReadRecorder); the measures of
measure.py per layer and head; then, in the output folder:
- reads.csv: one row per model x length x depth x sample x layer x head, at the answer position;
- spectra.csv: Sigma's eigenvalues at the answer position (one row per eigenvalue);
- positions.csv: lambda_t, the query's move and Sigma_t's effective rank at sampled positions;
- inspect.json: the settings (models, task, grid, baseline lambda, device, dtype);
- the figures of figures.py (PNG and PDF);
- with `mechanism_figure`, one more PNG at that path (figures.mechanism_figure: CCQ's read against the
  plain one per layer, for a README).
Tables and figures are written only after every model has been read, so a failure leaves the folder
as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ccq_eval.analysis.formatting import csv_safe
from ccq_eval.harness.run_options import DEFAULT_SEED
from ccq_eval.inspection import InspectError
from ccq_eval.inspection.prompts import needle_prompts, resolve_task

TABLES = ("reads.csv", "spectra.csv", "positions.csv")
DEFAULT_POSITIONS = 64


@dataclass
class InspectOptions:
    models: list[str]
    task: str = "s-niah-1"
    lengths: list[int] = field(default_factory=lambda: [1024])
    depths: list[float] = field(default_factory=lambda: [0.0, 50.0, 100.0])
    output: Path = Path("inspect")
    device: str = "auto"
    dtype: str = "float32"
    positions: int = DEFAULT_POSITIONS
    baseline_lambda: float | None = None
    seed: int = DEFAULT_SEED
    samples_per_cell: int = 1
    mechanism_figure: Path | None = None  # also write figures.mechanism_figure's PNG here


def check_models(names: list[str]) -> dict[str, Path]:
    """name -> checkpoint folder, refusing models without GLA / Gated DeltaNet layers before loading."""
    from ccq_eval.model.loading import checkpoint_family, resolve_checkpoint

    folders = {}
    for name in names:
        folder = resolve_checkpoint(name)
        family = checkpoint_family(folder)
        if not family.has_ccq:
            raise InspectError(
                f"{name} is a {family.model_type} model: inspect reads the CCQ read of GLA / Gated DeltaNet models; "
                "pass one of those (e.g. tiny-gla, tiny-gla-ccq, tiny-gdn, tiny-gdn-ccq)")
        folders[name] = folder
    return folders


def inspect_model(name: str, folder: Path, options: InspectOptions, device: str,
                  progress: Callable[[str], None] = lambda message: None) -> tuple[list, list, list]:
    """Rows of the three tables for one model, over every prompt of the grid."""
    import torch

    from ccq_eval.inspection.measure import CCQSettings, measure_layer, sample_positions
    from ccq_eval.inspection.reads import ReadRecorder
    from ccq_eval.model.loading import load_model

    if device == "cpu":
        from ccq_eval.harness.runner import cpu_threads

        torch.set_num_threads(cpu_threads())
    prompts = needle_prompts(options.task, str(folder), options.lengths, options.depths, options.seed,
                             options.samples_per_cell)
    model, _ = load_model(str(folder), device=device, dtype=options.dtype)
    settings = CCQSettings(model.config, options.baseline_lambda)
    trained = bool(getattr(model.config, "ccq", False))
    family = model.config.model_type.removeprefix("ccq_")
    rows, spectra, samples = [], [], []
    current = {}

    def measure(layer: int, read) -> None:
        """Measure a layer as soon as its kernel returns, so only one layer's read is held."""
        prompt, positions, base = current["prompt"], current["positions"], current["base"]
        layer_rows, layer_spectra, layer_samples = measure_layer(read, prompt, settings, positions)
        where = {**base, "layer": layer}
        rows.extend({**where, "prompt_tokens": len(prompt.input_ids), "answer_position": prompt.answer_position,
                     "needle_start": prompt.needle[0], "needle_end": prompt.needle[1],
                     "value_start": prompt.value[0], "value_end": prompt.value[1], **row} for row in layer_rows)
        spectra.extend({**where, **row} for row in layer_spectra)
        samples.extend({**where, **row} for row in layer_samples)

    recorder = ReadRecorder(model, on_read=measure)
    for prompt in prompts:
        progress(f"{name}: length {prompt.length}, depth {prompt.depth:g}")
        recorder.clear()
        current.update(prompt=prompt, positions=sample_positions(len(prompt.input_ids), options.positions, prompt),
                       base={"model": name, "family": family, "ccq_trained": trained, "task": prompt.task,
                             "length": prompt.length, "depth": prompt.depth, "sample": prompt.sample})
        ids = torch.tensor([prompt.input_ids], device=device)
        with torch.no_grad(), recorder.capture():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        if not bool(torch.isfinite(logits).all()):  # its reads would be written as blank cells, as if measured
            raise InspectError(f"model {name} ({folder}) gives NaN or infinite logits; nothing was written: look "
                               "for NaN / inf weights in its checkpoint")
        recorder.check_complete()
    del model
    return rows, spectra, samples


def run_inspect(options: InspectOptions, progress: Callable[[str], None] = lambda message: None) -> list[Path]:
    """Read every model on every prompt, then write the tables, inspect.json and the figures."""
    from ccq_eval.atomic_io import atomic_write_text
    from ccq_eval.harness.plan import PlanError, resolve_device

    resolve_task(options.task)
    if options.output.exists() and not options.output.is_dir():
        raise InspectError(f"--output {options.output} is a file; give a folder for the tables and figures")
    if options.positions < 0:
        raise InspectError(f"--positions must be >= 0, got {options.positions}")
    figure = options.mechanism_figure
    if figure is not None and (figure.suffix.lower() != ".png" or figure.is_dir()):
        raise InspectError(f"--mechanism-figure {figure}: give the path of a .png file (e.g. docs/ccq-mechanism.png)")
    if options.baseline_lambda is not None:
        from ccq_eval.harness.options import check_ccq_lambda

        try:
            check_ccq_lambda(options.baseline_lambda, f"--baseline-lambda {options.baseline_lambda:g}",
                             "--baseline-lambda 2")
        except PlanError as exc:
            raise InspectError(str(exc)) from None
    folders = check_models(options.models)
    try:
        device = resolve_device(options.device)
    except PlanError as exc:
        raise InspectError(str(exc)) from None
    tables = {name: [] for name in TABLES}
    for name, folder in folders.items():
        for table, part in zip(TABLES, inspect_model(name, folder, options, device, progress)):
            tables[table] += part
    options.output.mkdir(parents=True, exist_ok=True)
    frames = {table: pd.DataFrame(rows) for table, rows in tables.items()}
    written = []
    for table, frame in frames.items():
        atomic_write_text(options.output / table, csv_safe(frame).to_csv(index=False))
        written.append(options.output / table)
    settings = {"models": options.models, "task": options.task, "lengths": options.lengths, "depths": options.depths,
                "seed": options.seed, "samples_per_cell": options.samples_per_cell, "positions": options.positions,
                "baseline_lambda": options.baseline_lambda, "device": device, "dtype": options.dtype}
    atomic_write_text(options.output / "inspect.json", json.dumps(settings, indent=2) + "\n")
    written.append(options.output / "inspect.json")
    from ccq_eval.inspection import figures

    written += figures.draw_all(frames["reads.csv"], frames["spectra.csv"], frames["positions.csv"], options.output)
    if figure is not None:
        written.append(figures.mechanism_figure(frames["reads.csv"], figure))
    return written
