"""Load a checkpoint by registered name, local HF folder, or hub id, safely.

Safe by default: weights from safetensors only (pickle files, which can run code when loaded, need
`allow_pickle=True`), and no remote code unless `trust_remote_code=True`. Which classes load a checkpoint
follows its config.json `model_type` (families.family_of):
- fla GLA / Gated DeltaNet load into the CCQ classes with `ccq=False` by default, so they compute exactly
  fla's model while getting the project's generation fix and CPU backend;
- every other fla family loads into fla's own classes, with fla_cpu's backend and the generation fix;
- on a plain checkpoint of any backbone CCQ attaches to (families.ccq_backbone_types: GLA, Gated DeltaNet,
  DeltaNet, KDA, RetNet, Mamba2, Preconditioned Gated DeltaNet), `ccq=True` loads it into its family's CCQ
  class with the CCQ parameters at their initial values (training-free); `ccq_lambda` does so with the
  constant gate at exactly that lambda (what `ccq-eval run --ccq-attach` sweeps);
- any transformers causal LM (Llama, Qwen2, Mistral, ...) loads as transformers defines it.
Only the CCQ classes have CCQ.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ccq_eval.errors import UserError
from ccq_eval.logs import transformers_errors_only
from ccq_eval.model import checkpoint, fla_cpu
from ccq_eval.model.families import (
    Family,
    ccq_backbone_types,
    ccq_family_for,
    config_cpu_blocker,
    family_of,
    unknown_type_message,
)
from ccq_eval.model.modeling_ccq import CCQ_CLASSES, CCQConfigMixin, prepare_runtime
from ccq_eval.model.registry import MODEL_REGISTRY_PATH as REGISTRY_FILE
from ccq_eval.model.registry import MODELS_DIR, ModelEntry, RegistryError, load_model_registry

# The CCQ classes' model types with CCQ on unless the user says otherwise (the plain fla types load with it off).
CCQ_ON_BY_DEFAULT = tuple(config_class.model_type for config_class, _ in CCQ_CLASSES.values())
SAFE_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


class ModelLoadError(UserError, ValueError):
    """A checkpoint could not be loaded; the message says what was wrong and what to do."""


def registered_models() -> dict[str, ModelEntry]:
    """name -> entry of models/registry.json (registry.load_model_registry; its errors as ModelLoadError)."""
    try:
        return load_model_registry(REGISTRY_FILE)
    except RegistryError as error:
        raise ModelLoadError(str(error)) from None


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
        return (MODELS_DIR / registry[name_or_path].source).resolve()  # an absolute source stays as it is
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
        # Configs, weights and tokenizer files, never code; pickled weights (*.bin) are fetched but loaded
        # only with allow_pickle=True (load_model refuses them otherwise).
        return Path(snapshot_download(name_or_path, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken", "*.bin"]))
    except Exception as error:  # the hub library raises many kinds; all mean "not available here"
        raise ModelLoadError(
            f"could not fetch {name_or_path!r} from the hub ({type(error).__name__}: {error}). "
            f"Use a registered name ({known}) or a local checkpoint folder.") from error


def _special_float(fields: dict[str, Any]) -> Any:
    """transformers writes the floats JSON cannot hold (inf, nan) as {"__float__": "Infinity"} (Mamba2's
    dt_limit, for instance): read them back as floats, as its own config loader does."""
    if set(fields) == {"__float__"} and fields["__float__"] in ("Infinity", "-Infinity", "NaN"):
        return float(fields["__float__"])
    return fields


def _config_file_fields(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ModelLoadError(
            f"{folder} has no config.json: a checkpoint folder needs config.json and model.safetensors "
            "(a Hugging Face model folder, e.g. written by save_pretrained)")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"), object_hook=_special_float)
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from error


def checkpoint_family(folder: Path) -> Family:
    """The family that loads the checkpoint in `folder` (its config.json model_type); ModelLoadError naming
    the file when no installed library knows it."""
    fields = _config_file_fields(folder)
    model_type = fields.get("model_type")
    family = family_of(model_type)
    if family is None:
        remote = (" Its config names code of its own (auto_map), which ccq-eval does not run."
                  if fields.get("auto_map") else "")
        raise ModelLoadError(f"{folder / 'config.json'}: {unknown_type_message(model_type)}.{remote}")
    return family


def unrecognized_type_error(error: BaseException) -> ModelLoadError | None:
    """transformers' "model type `X` but Transformers does not recognize this architecture" (AutoConfig on a
    config.json whose model_type no imported library registered, e.g. under lm-eval's `--model hf`) as one
    line naming fla and the fix: transformers' own advice, to upgrade transformers, does not add fla's
    families. None for any other error."""
    head, found, _ = str(error).partition("` but Transformers does not recognize this architecture")
    if not isinstance(error, ValueError) or not found or "model type `" not in head:
        return None
    model_type = head.rsplit("model type `", 1)[1]
    if family_of(model_type) is None:
        return ModelLoadError(f"{unknown_type_message(model_type)}; upgrading transformers adds no fla family")
    kind = "a CCQ model of ccq-eval" if model_type.startswith("ccq_") else "an fla (flash-linear-attention) model"
    return ModelLoadError(
        f"model_type {model_type!r} is {kind}, which transformers knows only "
        "once ccq-eval or fla is imported (stock lm_eval imports neither; upgrading transformers does not help): "
        "run it with `ccq-eval lm-eval ...` (`--model ccq` on a CPU) or `ccq-eval run -m MODEL`")


def check_runs_on(folder: Path, device: str, dtype: str | torch.dtype | None = None) -> None:
    """ModelLoadError, in one line naming the checkpoint, its family, the reason and the alternative, when
    the checkpoint in `folder` cannot run on `device` (a family with no CPU version of its ops) or in `dtype`
    there (float32 on CUDA for a family whose kernel refuses it)."""
    family = checkpoint_family(folder)
    if str(device).startswith("cuda"):
        float32 = dtype is not None and resolve_dtype(dtype) == torch.float32
        if float32 and family.cuda_float32_blocker:
            raise ModelLoadError(f"{folder}: a {family.model_type} model cannot run in float32 on {device}: "
                                 f"{family.cuda_float32_blocker}; run it with --dtype bfloat16")
        return
    blocker = config_cpu_blocker(family, _config_file_fields(folder))
    if blocker:
        raise ModelLoadError(f"{folder}: a {family.model_type} model cannot run on {device}: {blocker}; run it "
                             "with --device cuda on a GPU machine")


def read_config(folder: Path, ccq: bool | None = None, **overrides):
    """The config of a checkpoint folder in its family's config class, validated (the CCQ class for GLA and
    Gated DeltaNet, and for a plain checkpoint of another CCQ backbone when `ccq` or an override turns CCQ
    on); `ccq` overrides the checkpoint's CCQ flag."""
    config_file = folder / "config.json"
    fields = _config_file_fields(folder)
    family = checkpoint_family(folder)
    model_type = family.model_type
    wants_ccq = bool(ccq) or bool(overrides.get("ccq"))
    if wants_ccq and not family.has_ccq and ccq_family_for(model_type) is not None:
        family = ccq_family_for(model_type)
    config_cls = family.config_class
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    if not family.has_ccq:
        if wants_ccq:
            raise ModelLoadError(f"{config_file}: model_type {model_type!r} has no CCQ (ccq-eval's CCQ backbones are "
                                 f"{', '.join(ccq_backbone_types())}); leave ccq unset for this model")
    else:
        fields.setdefault("ccq", model_type in CCQ_ON_BY_DEFAULT)
        if ccq is not None:
            fields["ccq"] = ccq
    fields.update(overrides)
    try:
        config = config_cls(**fields)
    except (ValueError, TypeError) as error:
        raise ModelLoadError(f"{config_file}: {error}") from error
    _check_field_types(config_file, config_cls, fields)
    return config


def _check_field_types(config_file: Path, config_cls: Any, fields: dict[str, Any]) -> None:
    """A number or flag written as text ("hidden_size": "256") would fail deep inside the model's
    construction without naming the file: refused here, naming file, field and value."""
    defaults = config_cls().to_dict()
    for key, value in fields.items():
        default = defaults.get(key)
        if isinstance(value, str) and isinstance(default, (bool, int, float)):
            kind = "true or false" if isinstance(default, bool) else "a number"
            raise ModelLoadError(f"{config_file}: \"{key}\": {value!r} is text; write {kind} without quotes "
                                 f"(e.g. {json.dumps(default)})")


def check_tokenizer_fits(folder: Path, model: Any, tokenizer: Any) -> None:
    """A tokenizer whose ids run past the model's embedding table (the tokenizer files of another model)
    would fail on the first prompt with torch's "index out of range in self"."""
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(rows, int) and isinstance(vocab, int) and vocab > rows:
        raise ModelLoadError(f"{folder}: its tokenizer has {vocab} tokens but the model's embedding table only {rows} "
                             "rows: the tokenizer files belong to another model; save this checkpoint's own "
                             "tokenizer beside its weights (tokenizer.save_pretrained(folder))")


# The config fields a training-free attachment sets itself: CCQ on, with the constant gate
# lambda_t = ccq_lambda_max * sigmoid(b) at exactly the asked lambda (constant_gate_fields).
CONSTANT_GATE_FIELDS = ("ccq", "ccq_gate", "ccq_lambda_max", "ccq_gate_bias_init")


def constant_gate_fields(lam: float) -> dict[str, Any]:
    """CCQ config fields that make lambda_t exactly `lam` at every position and head: the constant gate
    lambda_max * sigmoid(b) with b = 0 (sigmoid(0) = 0.5 exactly) and lambda_max = 2 lam; lam = 0 (where
    ccq_lambda_max must stay > 0) with b = -inf, sigmoid(-inf) = 0 (docs/operator.md: the identity case)."""
    if not math.isfinite(lam) or lam < 0:
        raise ModelLoadError(f"a CCQ attachment needs a finite lambda >= 0, got {lam!r}")
    if lam == 0:
        return {"ccq": True, "ccq_gate": "constant", "ccq_lambda_max": 1.0, "ccq_gate_bias_init": float("-inf")}
    return {"ccq": True, "ccq_gate": "constant", "ccq_lambda_max": 2.0 * lam, "ccq_gate_bias_init": 0.0}


def ccq_config_fields() -> list[str]:
    """The CCQ fields the config classes know (docs/operator.md: configuration), in their order."""
    return [name for name in inspect.signature(CCQConfigMixin._init_ccq).parameters if name.startswith("ccq")]


def check_ccq_attach_fields(fields: Mapping[str, Any]) -> None:
    """ModelLoadError unless every name in `fields` is a CCQ config field an attachment may set."""
    settable = [name for name in ccq_config_fields() if name not in CONSTANT_GATE_FIELDS]
    fixed = sorted(set(fields) & set(CONSTANT_GATE_FIELDS))
    if fixed:
        raise ModelLoadError(f"{', '.join(fixed)} cannot be set in a CCQ attachment: it sets them so that lambda_t "
                             "is exactly each lambda; give the values as lambda=...")
    unknown = sorted(set(fields) - set(settable))
    if unknown:
        valid = ", ".join(name.removeprefix("ccq_") for name in settable)
        raise ModelLoadError(f"unknown CCQ config field {', '.join(unknown)}; valid: {valid} (with or without "
                             "the ccq_ prefix)")


def ccq_attach_config(folder: Path, lam: float, fields: Mapping[str, Any] | None = None):
    """The CCQ-class config of a plain checkpoint of a CCQ backbone with CCQ attached training-free:
    the constant gate lambda_t = lam, plus `fields` (other CCQ config fields, full ccq_* names).
    ModelLoadError for a checkpoint that is CCQ already or has no CCQ (a Transformer), an unknown or
    reserved field, or a value the config refuses."""
    fields = dict(fields or {})
    check_ccq_attach_fields(fields)
    family = checkpoint_family(folder)
    model_type = family.model_type
    if ccq_family_for(model_type) is None:
        raise ModelLoadError(f"cannot attach CCQ to {folder.name}: a {model_type} model has no CCQ in ccq-eval (it "
                             f"attaches to {', '.join(ccq_backbone_types())}); attach it to a plain checkpoint of "
                             "one of those families")
    current = read_config(folder)
    if getattr(current, "ccq", False):
        raise ModelLoadError(f"cannot attach CCQ to {folder.name}: it is a CCQ checkpoint already (model_type "
                             f"{model_type}, ccq on, its own gate); attach to a plain checkpoint, or evaluate "
                             "this one without the attachment")
    return read_config(folder, **(fields | constant_gate_fields(lam)))


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


def _check_loaded_keys(folder: Path, loading_info: Mapping[str, Any], *, gate_may_be_missing: bool) -> None:
    """ModelLoadError unless the model took all and only the checkpoint's tensors: transformers would leave
    a missing tensor random and drop a surplus one (a config edited to fewer layers, a CCQ checkpoint
    labelled as plain GLA, which loses its gate) with no more than a log line. The one exception is CCQ
    attached to a baseline checkpoint (gate_may_be_missing): its gate has none in the weights and starts at
    its fixed initial values."""
    missing = [key for key in loading_info.get("missing_keys") or []
               if not (gate_may_be_missing and ".ccq_gate_" in key)]
    unexpected = list(loading_info.get("unexpected_keys") or [])
    fix = ("use the config.json saved with these weights (model_type, ccq and the layer count decide which "
           "tensors a model takes), or re-save the checkpoint with model.save_pretrained(folder)")
    if missing:
        raise ModelLoadError(f"{folder}: the weights lack {len(missing)} tensors the config needs (e.g. "
                             f"{', '.join(sorted(missing)[:3])}): {fix}")
    if unexpected:
        raise ModelLoadError(f"{folder}: the weights hold {len(unexpected)} tensors the config does not use (e.g. "
                             f"{', '.join(sorted(unexpected)[:3])}), which would be dropped: {fix}")


def load_model(
    name_or_path: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    ccq: bool | None = None,
    ccq_lambda: float | None = None,
    ccq_fields: Mapping[str, Any] | None = None,
):
    """(model, tokenizer) in eval mode on `device`. `ccq` forces CCQ on or off (None: the checkpoint's).
    `ccq_lambda` attaches CCQ training-free to a plain checkpoint of a CCQ backbone with the constant
    gate lambda_t = ccq_lambda and the other CCQ config fields in `ccq_fields` (ccq_attach_config)."""
    prepare_runtime()
    torch_dtype = resolve_dtype(dtype)
    folder = resolve_checkpoint(name_or_path)
    checkpoint_family(folder)  # an unknown model_type stops here, on every device
    check_runs_on(folder, str(device), torch_dtype)
    if ccq_lambda is None:
        if ccq_fields:
            raise ModelLoadError("ccq_fields belong to a CCQ attachment: give ccq_lambda too")
        config = read_config(folder, ccq=ccq)
    else:
        config = ccq_attach_config(folder, ccq_lambda, ccq_fields)
    use_safetensors = _check_weights(folder, allow_pickle)
    family = family_of(config.model_type)  # a CCQ family where CCQ is attached to a plain checkpoint
    model_cls = family.model_class
    try:
        # Attaching CCQ, the gate is missing from the weights by design: transformers' load report would call
        # it "newly initialized"; _check_loaded_keys below judges the keys in every case.
        with transformers_errors_only() if ccq_lambda is not None else contextlib.nullcontext():
            model, loading_info = model_cls.from_pretrained(
                folder, config=config, use_safetensors=use_safetensors, dtype=torch_dtype or torch.float32,
                trust_remote_code=trust_remote_code, local_files_only=True, output_loading_info=True,
            )
    except RuntimeError:  # transformers: tensor shapes of the weights differ from the config's
        raise ModelLoadError(
            f"{folder}: config.json does not match the tensor shapes of its weights (the report above lists "
            "them); use the config.json saved with these weights") from None
    attaching_ccq = bool(getattr(config, "ccq", False)) and not getattr(read_config(folder), "ccq", False)
    _check_loaded_keys(folder, loading_info, gate_may_be_missing=attaching_ccq)
    if ccq_lambda is not None and not any(key.endswith(".ccq_gate_bias")
                                          for key in loading_info.get("missing_keys") or []):
        raise ModelLoadError(f"cannot attach CCQ to {folder.name}: its weights hold a CCQ gate, which would replace "
                             "the attached lambda; attach to a plain checkpoint")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{folder} has no usable tokenizer files ({error}); save the tokenizer with the checkpoint "
            "(tokenizer.save_pretrained(folder))") from error
    check_tokenizer_fits(folder, model, tokenizer)
    if family.source == "fla":
        fla_cpu.use_torch_backend(model)
        model.register_forward_pre_hook(read_generate_cache_keyword, with_kwargs=True)
    return model.to(device).eval(), tokenizer


def read_generate_cache_keyword(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook for fla's own causal LMs: transformers >= 5.2x's generate() passes the recurrent
    cache as `cache`, which fla 0.6.0's forward ignores (it reads `past_key_values`), so decoding would
    restart from an empty state every step. The CCQ classes do the same in their forward."""
    if kwargs.get("cache") is not None and kwargs.get("past_key_values") is None:
        kwargs["past_key_values"] = kwargs.pop("cache")
    return args, kwargs
