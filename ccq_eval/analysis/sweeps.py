"""The --ccq-attach sweeps of a results folder: which model is which lambda of which sweep, read from the
spec each unit's meta.json records (model names are never parsed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from ccq_eval.harness import store


def ccq_attachment(meta: Any) -> dict[str, Any] | None:
    """The --ccq-attach entry of a unit's spec as its meta.json records it (sweep, lambda, fields and, for
    runs that evaluate the plain model too, baseline: that model's name); None for other units."""
    attach = ((meta.get("spec") or {}) if isinstance(meta, dict) else {}).get("ccq_attach")
    if isinstance(attach, dict) and "sweep" in attach and isinstance(attach.get("lambda"), (int, float)):
        return attach
    return None


def sweep_attachments(metas: Iterable[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each attached model's --ccq-attach entry (ccq_attachment), from (model, meta.json) pairs. An entry
    without its baseline's name (runs before the plain model was evaluated with the sweep) gets the
    plain model of the folder whose checkpoint fingerprint is the attached unit's, when exactly one is."""
    attachments: dict[str, dict[str, Any]] = {}
    plain_by_checkpoint: dict[str, set[str]] = {}
    checkpoints: dict[str, str] = {}
    for model, meta in metas:
        spec = (meta.get("spec") or {}) if isinstance(meta, dict) else {}
        fingerprint = json.dumps(spec.get("checkpoint"), sort_keys=True) if spec.get("checkpoint") else None
        attach = ccq_attachment(meta)
        if attach is not None:
            attachments.setdefault(model, attach)
            if fingerprint:
                checkpoints.setdefault(model, fingerprint)
        elif fingerprint:
            plain_by_checkpoint.setdefault(fingerprint, set()).add(model)
    for model, attach in attachments.items():
        plain = plain_by_checkpoint.get(checkpoints.get(model, ""), set())
        if "baseline" not in attach and len(plain) == 1:
            attachments[model] = {**attach, "baseline": next(iter(plain))}
    return attachments


def sweep_points(attachments: dict[str, dict[str, Any]], models: Iterable[str]) -> pd.DataFrame:
    """The points of every --ccq-attach sweep: columns model, sweep and lambda, from each attached model's
    entry (ccq_attachment) and the names of all models with results. A sweep's lambda = 0 is its attached
    lambda-0 model where one was evaluated, else the plain model its entries name as their baseline, when
    that has results; a plain model can be the lambda = 0 of several sweeps (one row each)."""
    present = set(models)
    rows = {(str(attach["sweep"]), model): float(attach["lambda"]) for model, attach in attachments.items()}
    with_zero = {sweep for (sweep, _), lam in rows.items() if lam == 0}
    for attach in attachments.values():
        sweep, baseline = str(attach["sweep"]), attach.get("baseline")
        if sweep not in with_zero and isinstance(baseline, str) and baseline in present:
            rows[(sweep, baseline)] = 0.0
    return pd.DataFrame(
        [(model, sweep, lam) for (sweep, model), lam in sorted(rows.items(), key=lambda r: (r[0][0], r[1]))],
        columns=["model", "sweep", "lambda"],
    )


def ccq_sweep_points(tidy: pd.DataFrame) -> pd.DataFrame:
    """sweep_points of the models in the tidy frame, their entries read from the spec each unit's meta.json
    records (the model names are not parsed)."""
    metas = []
    for model, source in tidy[["model", "source"]].drop_duplicates().itertuples(index=False):
        meta_path = Path(source).parent / store.META_FILE
        if store.is_unit_results(Path(source)) and meta_path.is_file():
            metas.append((model, store.read_meta(meta_path)))
    return sweep_points(sweep_attachments(metas), tidy["model"].unique())
