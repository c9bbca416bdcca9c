"""One causal LM as the lm-eval adapter calls it: a slice of tokens through the model with a carried cache.

For fla models the backbone's hidden states come back and the caller forms logits with the LM head a
few positions at a time; any other model returns its logits. The calling convention (cache keyword,
`logits_to_keep`) is read from the model's forward signature.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ccq_eval.model.families import family_of


def _backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """(backbone, LM head) of an fla causal LM, whose logits are exactly lm_head(backbone(...)[0])
    (FLAForCausalLM.forward without labels; fla's Mamba family, which derives from FLAPreTrainedModel alone,
    computes them the same way through FLAPreTrainedModel._compute_logits_and_loss from its `backbone`);
    (None, None) for any other model."""
    try:
        from fla.models.modeling_utils import FLAForCausalLM, FLAPreTrainedModel
    except ImportError:  # fla absent: no fla model can be here
        return None, None
    if isinstance(model, FLAForCausalLM):
        return model.get_decoder(), model.get_output_embeddings()
    backbone = getattr(model, "backbone", None)
    if (isinstance(model, FLAPreTrainedModel) and isinstance(backbone, torch.nn.Module)
            and "_compute_logits_and_loss" in inspect.unwrap(type(model).forward).__code__.co_names):
        return backbone, model.get_output_embeddings()
    return None, None


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    """Keyword names the model's forward accepts, following `**kwargs` pass-through into the
    parent class's forward (our CCQ classes wrap fla's forward that way)."""
    names: set[str] = set()
    for cls in type(model).__mro__:
        if cls is torch.nn.Module:
            break
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        params = inspect.signature(forward).parameters
        names.update(params)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return names


class ModelRuntime:
    """A loaded causal LM (in eval mode) and how to call it.

    Attributes:
        model: the model.
        device: the device of its parameters (made the current CUDA device when it is one).
        backbone, lm_head: an fla model's decoder and output embeddings, else None.
        sliced_cache: whether a text can go through the model in slices of several tokens carrying one cache
            (False for fla's Mamba family, whose cache takes one token per call once it holds a state).
        gpu_fast_path_measured: whether its family's CUDA fast path (graphs, memory batching) was checked
            against batch 1 (families.GPU_FAST_PATH_MEASURED); the adapter's auto mode uses it only then.
        recurrent: a purely recurrent fla model (no hybrid attention layers, config.attn): it keeps no
            per-position state, so prompts of different lengths can decode in one batch.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.device: torch.device = next(model.parameters()).device
        if self.device.type == "cuda":
            # The model's GPU made current: CUDA graphs capture on the current device's streams, and
            # kernels that take no device from their inputs launch there (device="cuda:1").
            torch.cuda.set_device(self.device)
        # Model-agnostic calling convention: fla reads `past_key_values`; transformers >= 5.2x
        # renamed it `cache`. Pick whichever the forward declares.
        params = _forward_parameters(model)
        self.cache_kwarg = "past_key_values" if "past_key_values" in params else (
            "cache" if "cache" in params else "past_key_values")
        self.has_logits_to_keep = "logits_to_keep" in params
        self.backbone, self.lm_head = _backbone_and_head(model)
        family = family_of(getattr(getattr(model, "config", None), "model_type", None))
        self.sliced_cache = family is None or family.sliced_cache
        self.gpu_fast_path_measured = family is not None and family.gpu_fast_path_measured
        self.recurrent = self.backbone is not None and not getattr(model.config, "attn", None)

    @property
    def name(self) -> str:
        return type(self.model).__name__

    def forward(self, input_ids: torch.Tensor, cache: Any, logits_to_keep: int) -> tuple[torch.Tensor, Any]:
        """One slice through the model with the carried cache. Returns (logits of the last
        `logits_to_keep` positions, or all when 0 / unsupported, new cache)."""
        features, new_cache = self.forward_features(input_ids, cache, logits_to_keep)
        return self.logits(features), new_cache

    def forward_features(self, input_ids: torch.Tensor, cache: Any, keep: int,
                         use_cache: bool = True) -> tuple[torch.Tensor, Any]:
        """Like forward, but for fla models the backbone's hidden states of the last `keep`
        positions instead of logits (turned into logits by `logits`, a slice at a time).
        use_cache=False: the last slice of a text whose cache nobody reads (no cache returned)."""
        if self.backbone is not None:
            out = self.backbone(input_ids=input_ids, past_key_values=cache, use_cache=use_cache)
            hidden = out[0]
            return (hidden[:, -keep:] if keep else hidden), out.past_key_values
        kwargs: dict[str, Any] = {"use_cache": use_cache}
        if cache is not None:
            kwargs[self.cache_kwarg] = cache
        if self.has_logits_to_keep and keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(input_ids=input_ids, **kwargs)
        new_cache = out.get("past_key_values")
        if new_cache is None:
            new_cache = out.get("cache")
        logits = out["logits"]
        if keep:
            logits = logits[:, -keep:]
        return logits, new_cache

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype from what forward_features returned."""
        return features if self.lm_head is None else self.lm_head(features)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """fp32 (at least) logits from what forward_features returned."""
        logits = self.head(features)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def tensor(self, rows: list[list[int]]) -> torch.Tensor:
        """Token rows as a long tensor on the model's device."""
        ids = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            # From pinned memory the copy is queued behind the GPU's work instead of waiting for it.
            return ids.pin_memory().to(self.device, non_blocking=True)
        return ids.to(self.device)

    @staticmethod
    def to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of `values` queued in stream order, and the event to synchronize on before reading
        it (None: already there). Waiting on the event waits for this copy only, not for GPU work queued
        after it."""
        if values.device.type != "cuda":
            return values.cpu(), None
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return host, copied
