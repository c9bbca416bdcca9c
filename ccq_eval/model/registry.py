"""The registry of named models (models/registry.json): what `ccq-eval models` lists and `run --model`
accepts besides checkpoint folders. Reading it needs no torch.

The repository's models/ folder is installed as the package data of `ccq_eval.models` (pyproject.toml),
so the embedded names resolve the same from a checkout, an editable install and a wheel.
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from ccq_eval.errors import UserError

# A regular package on the file system: files() is its folder (checkpoints are loaded from files).
MODELS_DIR = Path(str(importlib.resources.files("ccq_eval.models")))
MODEL_REGISTRY_PATH = MODELS_DIR / "registry.json"
FALLBACK_DEFAULT_MODELS = ["tiny-gla", "tiny-gla-ccq", "tiny-gdn", "tiny-gdn-ccq", "tiny-transformer"]


class RegistryError(UserError):
    """The registry file cannot be read; the message names it and what is wrong."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str  # what ccq_eval.model.loading.load_model receives
    description: str = ""
    default: bool = False


def load_model_registry(path: Path | None = None) -> dict[str, ModelEntry]:
    """models/registry.json as {name: ModelEntry}; an absent file gives an empty registry.

    Format (ccq_eval.model.loading): {name: {"path": <folder, relative to models/>, "description",
    "default": bool}}; a list of {"name", "path", ...} is accepted too.
    """
    path = Path(MODEL_REGISTRY_PATH if path is None else path)
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RegistryError(f"cannot read the model registry {path}: {exc}; fix or delete it") from None
    entries = raw.get("models", raw) if isinstance(raw, dict) else raw
    if isinstance(entries, dict):
        items = [dict(value, name=key) if isinstance(value, dict) else {"name": key, "path": value}
                 for key, value in entries.items()]
    elif isinstance(entries, list) and all(isinstance(item, dict) for item in entries):
        items = [dict(item) for item in entries]
    else:
        raise RegistryError(f"{path}: expected a JSON object or list of models")
    registry = {}
    for number, item in enumerate(items, start=1):
        if "name" not in item:
            raise RegistryError(f"{path}: model entry {number} has no \"name\"; give every entry its name")
        name = str(item["name"])
        source = item.get("path") or item.get("source") or item.get("checkpoint")
        if not source:
            raise RegistryError(f"{path}: model {name!r} has no \"path\"; give its checkpoint folder (relative "
                                f"to {path.parent}) or hub id as \"path\"")
        if not Path(str(source)).is_absolute() and (Path(path).parent / str(source)).exists():
            source = str((Path(path).parent / str(source)).resolve())
        registry[name] = ModelEntry(
            name=name,
            source=str(source),
            description=str(item.get("description", "")),
            default=bool(item.get("default", False)),
        )
    return registry


def registered_folder(name: str) -> Path | None:
    """The checkpoint folder a registered model's name stands for; None for a name the registry lacks.
    Needs neither torch nor fla, so the tasks can find a model's tokenizer without loading the model stack."""
    entry = load_model_registry().get(name)
    return None if entry is None else (MODELS_DIR / entry.source).resolve()  # an absolute source stays as it is


def default_model_names(registry: dict[str, ModelEntry]) -> list[str]:
    flagged = [entry.name for entry in registry.values() if entry.default]
    return flagged or [name for name in FALLBACK_DEFAULT_MODELS if name in registry]
