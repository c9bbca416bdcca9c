"""Which models a run evaluates: --model names (registry names, checkpoint folders, hub ids) resolved to
ModelEntry objects, with --ccq-attach's lambdas and the default run's CCQ sweep, each checked to have a
results folder of its own and a readable checkpoint folder; and how the tasks are told each model's
tokenizer. Loads no model; raises PlanError.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccq_eval.harness.options import CCQAttach, PlanError, parse_ccq_attach
from ccq_eval.harness.run_options import RunOptions
from ccq_eval.harness.store import slugify
from ccq_eval.model import checkpoint
from ccq_eval.model import registry as model_registry_module
from ccq_eval.model.registry import ModelEntry, default_model_names

# Beside the default models, the default run shows what CCQ does training-free: each default model that has
# its CCQ twin NAME-ccq among the defaults is also evaluated with CCQ attached at these constant lambdas
# (lambda = 0 is the model itself), on the default sweep tasks of the same grid (the same documents, so
# every lambda pairs with the baseline sample by sample).
DEFAULT_SWEEP_ATTACH = "lambda=1,2"


@dataclass
class ResolvedModels:
    """The models of a run: each ModelEntry, the --ccq-attach entry of the attached ones (their units'
    spec["ccq_attach"]) and the names of the default sweep's models (evaluated on its tasks only)."""

    models: list[ModelEntry]
    attachments: dict[str, dict[str, Any]] = field(default_factory=dict)
    sweep_only: set[str] = field(default_factory=set)


def resolve_models(
    options: RunOptions, registry: dict[str, ModelEntry], attach: CCQAttach | None, using_defaults: bool
) -> ResolvedModels:
    """options.models (or the registry's defaults) -> the run's models; raises PlanError."""
    model_names = list(options.models) or default_model_names(registry)
    if not model_names:
        raise PlanError(
            f"no --model given and no default models in {model_registry_module.MODEL_REGISTRY_PATH}; "
            "give --model NAME (a registry name or a checkpoint folder)"
        )
    models = [_model_entry(name, registry) for name in model_names]
    labels = [m.name for m in models]
    if len(set(labels)) != len(labels):
        raise PlanError(f"--model names the same model twice: {', '.join(labels)}")
    resolved = ResolvedModels(models)
    if attach is not None:
        resolved.models, resolved.attachments = attached_models(models, attach)
    if not options.models and using_defaults and attach is None:
        resolved = _with_default_sweep(models)
    _check_folders(resolved.models)
    return resolved


def _model_entry(name: str, registry: dict[str, ModelEntry]) -> ModelEntry:
    """One --model name: a registry name, a checkpoint folder or (online) a hub id."""
    if name in registry:
        return registry[name]
    if Path(name).expanduser().is_dir():
        folder = Path(name).expanduser().resolve()
        if folder.parent == folder:
            raise PlanError(
                f"--model {name!r}: the filesystem root is not a checkpoint folder; pass the "
                "folder that holds config.json and model.safetensors"
            )
        return ModelEntry(name=folder.name, source=str(folder))
    if _looks_like_hub_id(name) and not _hub_offline():
        return ModelEntry(name=name.replace("/", "__"), source=name)
    choices = ", ".join(sorted(registry)) or "(the registry is empty)"
    hub = " (hub ids need HF_HUB_OFFLINE unset)" if _looks_like_hub_id(name) else ""
    raise PlanError(
        f"unknown model {name!r}: give a registered name ({choices}) or an existing checkpoint "
        f"folder{hub}; `ccq-eval models` lists the registered ones"
    )


def _check_folders(models: list[ModelEntry]) -> None:
    """Each model needs a results folder of its own, and a local checkpoint folder must be readable."""
    by_folder: dict[str, str] = {}
    for model in models:
        try:
            folder_name = slugify(model.name)
        except ValueError:
            raise PlanError(
                f"--model {model.name!r}: no results folder can be named after it; rename the "
                "checkpoint folder (letters, digits, . _ -)"
            ) from None
        if folder_name in by_folder:
            raise PlanError(
                f"--model {by_folder[folder_name]!r} and {model.name!r} would share the results folder "
                f"{folder_name!r}; rename one of the checkpoint folders, or run them into different "
                "--output folders"
            )
        by_folder[folder_name] = model.name
        if Path(model.source).is_dir():
            try:
                checkpoint.check_checkpoint_folder(Path(model.source))
            except checkpoint.CheckpointError as exc:
                raise PlanError(f"--model {model.name}: {exc}") from None


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def _with_default_sweep(models: list[ModelEntry]) -> ResolvedModels:
    """The default models plus the default sweep: each model whose CCQ twin NAME-ccq is among them with CCQ
    attached at DEFAULT_SWEEP_ATTACH's lambdas (the model itself is the sweep's lambda = 0, planned once)."""
    names = {model.name for model in models}
    baselines = [model for model in models if f"{model.name}-ccq" in names]
    if not baselines:
        return ResolvedModels(models)
    try:
        expanded, attachments = attached_models(baselines, parse_ccq_attach(DEFAULT_SWEEP_ATTACH))
    except PlanError as exc:
        raise PlanError(
            f"the default run's CCQ sweep ({DEFAULT_SWEEP_ATTACH}): {exc}; run with --model to "
            "choose the models"
        ) from None
    added = [model for model in expanded if model.name not in names]
    return ResolvedModels(models + added, attachments, {model.name for model in added})


def attached_models(models: list[ModelEntry], attach: CCQAttach) -> tuple[list[ModelEntry], dict[str, dict]]:
    """--ccq-attach: each model itself under its own name (the sweep's lambda = 0: the real baseline, one
    unit whether or not the model is also asked plainly) and once per lambda > 0, named as
    CCQAttach.model_name says, with the ccq_attach entry of each attached model's unit specs (the runner
    loads the model with it; "baseline" names the plain model that is the sweep's lambda = 0). The fields
    and every local checkpoint are checked with the config classes first (imports torch and fla; loads no
    weights)."""
    from ccq_eval.model import loading

    expanded, attachments = [], {}
    for model in models:
        try:
            if Path(model.source).is_dir():
                loading.ccq_attach_config(Path(model.source), max(attach.lambdas), attach.fields)
            else:  # a hub id: its config is checked when it is fetched
                loading.check_ccq_attach_fields(attach.fields)
        except loading.ModelLoadError as exc:
            raise PlanError(f"--ccq-attach: {exc}") from None
        expanded.append(model)
        for lam in attach.lambdas:
            if lam == 0:  # the plain checkpoint computes it
                continue
            name = attach.model_name(model.name, lam)
            expanded.append(ModelEntry(name=name, source=model.source,
                                       description=f"{model.name} with CCQ attached at lambda = {lam:g}"))
            attachments[name] = {"sweep": attach.sweep_name(model.name), "lambda": lam, "fields": dict(attach.fields),
                                 "baseline": model.name}
    return expanded, attachments


def tokenizer_metadata(model: ModelEntry, fingerprint: dict[str, Any] | None) -> dict[str, str]:
    """What the tasks are told of `model`'s tokenizer, so that their documents name no path of this machine:
    "tokenizer", what they load it from (the registered name of a model of the installed registry, which the
    tasks resolve themselves; a hub id; else the checkpoint folder), and "tokenizer_name", what documents
    record of it (the registered name, the hub id, or for a folder <folder name>@<12 hex digits of its
    checkpoint fingerprint>, the same for every copy of the checkpoint)."""
    source = Path(model.source)
    try:
        installed = model_registry_module.load_model_registry()
    except model_registry_module.RegistryError:  # the run's own registry was read already; the tasks name none
        installed = {}
    registered = [name for name, entry in installed.items() if entry.source == model.source]
    if registered:
        return {"tokenizer": registered[0], "tokenizer_name": registered[0]}
    if not source.is_dir() or fingerprint is None:
        return {"tokenizer": model.source, "tokenizer_name": model.source}
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode("utf-8")).hexdigest()
    return {"tokenizer": str(source.resolve()), "tokenizer_name": f"{source.name}@{digest[:12]}"}
