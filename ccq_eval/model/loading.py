"""Load a checkpoint by registered name, local HF folder, or hub id, safely.

Safe by default: weights from safetensors only (pickle files, which can run code when loaded, need
`allow_pickle=True`), and no remote code unless `trust_remote_code=True`. fla GLA / Gated DeltaNet
checkpoints load into the CCQ classes with `ccq=False` by default, so they compute exactly fla's model
while getting the project's generation fix and CPU backend; `ccq=True` attaches CCQ to them with its
parameters at their initial values (training-free). transformers' Llama checkpoints (the
softmax-attention reference) load as they are; they have no CCQ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ccq_eval.model import checkpoint
from ccq_eval.model.modeling_ccq import (
    CCQGatedDeltaNetConfig,
    CCQGatedDeltaNetForCausalLM,
    CCQGLAConfig,
    CCQGLAForCausalLM,
    prepare_runtime,
)

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
REGISTRY_FILE = MODELS_DIR / "registry.json"

# model_type in config.json -> (config class, model class, whether CCQ is on unless the user says;
# None: the model has no CCQ, e.g. the softmax-attention reference).
SUPPORTED_MODEL_TYPES = {
    "gla": (CCQGLAConfig, CCQGLAForCausalLM, False),
    "ccq_gla": (CCQGLAConfig, CCQGLAForCausalLM, True),
    "gated_deltanet": (CCQGatedDeltaNetConfig, CCQGatedDeltaNetForCausalLM, False),
    "ccq_gated_deltanet": (CCQGatedDeltaNetConfig, CCQGatedDeltaNetForCausalLM, True),
    "llama": (LlamaConfig, LlamaForCausalLM, None),
}
SAFE_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded; the message says what was wrong and what to do."""


def registered_models() -> dict[str, dict]:
    """name -> entry of models/registry.json ({"path", "description", "default", ...})."""
    if not REGISTRY_FILE.exists():
        return {}
    try:
        return json.loads(REGISTRY_FILE.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"the model registry {REGISTRY_FILE} is not valid JSON: {error}") from error


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def resolve_checkpoint(name_or_path: str) -> Path:
    """A registered name, a local folder, or a hub id (downloaded when the hub is reachable)."""
    registry = registered_models()
    if name_or_path in registry:
        return (MODELS_DIR / registry[name_or_path]["path"]).resolve()
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path} is a file; pass the checkpoint folder (with config.json) instead")
        return path.resolve()
    known = ", ".join(sorted(registry)) or "(none registered)"
    looks_like_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ModelLoadError(
            f"unknown model {name_or_path!r}: not a registered name ({known}) and no such folder")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ModelLoadError(
            f"{name_or_path!r} looks like a hub id, but the hub is offline (HF_HUB_OFFLINE is set). "
            f"Use a registered name ({known}) or a local checkpoint folder.")
    from huggingface_hub import snapshot_download

    try:
        # Only configs, safetensors and tokenizer files: never code, never pickles by accident.
        return Path(snapshot_download(name_or_path, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken", "*.bin"]))
    except Exception as error:  # the hub library raises many kinds; all mean "not available here"
        raise ModelLoadError(
            f"could not fetch {name_or_path!r} from the hub ({type(error).__name__}: {error}). "
            f"Use a registered name ({known}) or a local checkpoint folder.") from error


def read_config(folder: Path, ccq: bool | None = None, **overrides):
    """The CCQ-class config for a checkpoint folder, validated; `ccq` overrides the checkpoint's flag."""
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ModelLoadError(
            f"{folder} has no config.json: a checkpoint folder needs config.json and model.safetensors "
            "(a Hugging Face model folder, e.g. written by save_pretrained)")
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from error
    model_type = fields.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{config_file}: unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}")
    config_cls, _, ccq_default = SUPPORTED_MODEL_TYPES[model_type]
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    if ccq_default is None:
        if ccq:
            raise ModelLoadError(f"{config_file}: model_type {model_type!r} has no CCQ (CCQ applies to GLA and "
                                 "Gated DeltaNet); leave ccq unset for this model")
    else:
        fields.setdefault("ccq", ccq_default)
        if ccq is not None:
            fields["ccq"] = ccq
    fields.update(overrides)
    try:
        return config_cls(**fields)
    except (ValueError, TypeError) as error:
        raise ModelLoadError(f"{config_file}: {error}") from error


def _check_weights(folder: Path, allow_pickle: bool) -> bool:
    """True for safetensors weights; pickle weights only with the explicit opt-in."""
    if any((folder / name).exists() for name in SAFE_WEIGHT_FILES):
        for path in sorted(folder.glob("*.safetensors")):
            try:
                checkpoint.check_safetensors(path)
            except checkpoint.CheckpointError as error:
                raise ModelLoadError(str(error)) from None
        return True
    if any((folder / name).exists() for name in PICKLE_WEIGHT_FILES):
        if not allow_pickle:
            raise ModelLoadError(checkpoint.pickle_only_message(folder))
        return False
    raise ModelLoadError(f"{folder} has no weights: expected one of {SAFE_WEIGHT_FILES}")


def load_model(
    name_or_path: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    ccq: bool | None = None,
):
    """(model, tokenizer) in eval mode on `device`. `ccq` forces CCQ on or off (None: the checkpoint's)."""
    prepare_runtime()
    torch_dtype = resolve_dtype(dtype)
    folder = resolve_checkpoint(name_or_path)
    config = read_config(folder, ccq=ccq)
    use_safetensors = _check_weights(folder, allow_pickle)
    _, model_cls, _ = SUPPORTED_MODEL_TYPES[config.model_type]  # the CCQ class of either family
    try:
        model, loading_info = model_cls.from_pretrained(
            folder, config=config, use_safetensors=use_safetensors, dtype=torch_dtype or torch.float32,
            trust_remote_code=trust_remote_code, local_files_only=True, output_loading_info=True,
        )
    except RuntimeError:  # transformers: tensor shapes of the weights differ from the config's
        raise ModelLoadError(
            f"{folder}: config.json does not match the tensor shapes of its weights (the report above lists "
            "them); use the config.json saved with these weights") from None
    # CCQ's gate, absent from a baseline checkpoint loaded with ccq=True, starts at its fixed initial
    # values (no random numbers); any other missing tensor would be left random by transformers.
    missing = [key for key in loading_info.get("missing_keys") or [] if ".ccq_gate_" not in key]
    if missing:
        raise ModelLoadError(
            f"{folder}: the weights lack {len(missing)} tensors the config needs (e.g. {min(missing)}); "
            "use the config.json saved with these weights, or re-save the checkpoint")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{folder} has no usable tokenizer files ({error}); save the tokenizer with the checkpoint "
            "(tokenizer.save_pretrained(folder))") from error
    return model.to(device).eval(), tokenizer
