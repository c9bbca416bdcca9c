"""Patch fla so that its GLA / Gated DeltaNet models run on CPU; CUDA tensors keep fla's kernels.

`install()` replaces the op names fla's layers call with the dispatchers of `dispatch`, and the
forward of fla's norm, convolution and loss modules with device-dispatching ones. Nothing is
patched on import: the model loader and the lm-eval adapter call `install()`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ccq_eval.model.fla_cpu import dispatch
from ccq_eval.model.fla_cpu.delta_rule import torch_l2norm
from ccq_eval.model.fla_cpu.dqkwg import install_hopper_dqkwg_fix
from ccq_eval.model.fla_cpu.modules import (
    torch_causal_conv1d,
    torch_causal_conv1d_update,
    torch_cross_entropy,
    torch_rms_norm,
    torch_rms_norm_gated,
)


def _short_conv_forward_cpu(
    self,
    x,
    residual=None,
    mask=None,
    cache=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_indices=None,
    **kwargs,
):
    """ShortConvolution.forward on CPU, following fla's control flow: a no-grad call with one token
    per sequence is a decode step that updates `cache` in place; anything else is a full conv."""
    if kwargs.get("cp_context") is not None:
        raise NotImplementedError("ShortConvolution on CPU: context parallelism (cp_context) is CUDA-only.")
    B, T = x.shape[:2]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if mask is not None:
        if cu_seqlens is not None:
            raise ValueError("ShortConvolution: pass either mask or cu_seqlens, not both.")
        x = x * mask.unsqueeze(-1)
    weight = self.weight.squeeze(1)  # [D, 1, W] -> [D, W]
    single_token = B * T == N and (cu_seqlens is None or bool((cu_seqlens.diff() == 1).all()))
    if not torch.is_grad_enabled() and single_token:
        if cache is None:
            cache = x.new_zeros(N, x.shape[-1], weight.shape[1])
        y, cache = torch_causal_conv1d_update(x, cache, residual, weight, self.bias, self.activation)
        return y, (cache if output_final_state else None)
    return torch_causal_conv1d(
        x, weight, self.bias, residual, cache, output_final_state, self.activation, cu_seqlens
    )


def _rms_norm_forward_cpu(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    return torch_rms_norm(x, self.weight, self.bias, residual, self.eps, prenorm, residual_in_fp32)


def _rms_norm_gated_forward_cpu(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    return torch_rms_norm_gated(
        x, g, self.weight, self.bias, self.activation, residual, self.eps, prenorm, residual_in_fp32
    )


def _l2norm_forward_cpu(self, x):
    return torch_l2norm(x, self.eps, self.output_dtype)


def _cross_entropy_forward_cpu(self, input, target):
    if self.process_group is not None:
        raise NotImplementedError(
            "FusedCrossEntropyLoss on CPU: a vocabulary-parallel process_group is CUDA-only."
        )
    loss, z_loss = torch_cross_entropy(
        input,
        target,
        ignore_index=self.ignore_index,
        reduction=self.reduction,
        label_smoothing=self.label_smoothing,
        logit_scale=self.logit_scale,
        lse_square_scale=self.lse_square_scale,
        logit_softcapping=self.logit_softcapping,
    )
    return (loss, z_loss) if self.return_z_loss else loss


def _linear_cross_entropy_forward_cpu(self, x, target, weight, bias=None):
    if self.process_group is not None:
        raise NotImplementedError(
            "FusedLinearCrossEntropyLoss on CPU: a vocabulary-parallel process_group is CUDA-only."
        )
    from fla.modules.l2warp import L2Wrap

    logits = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    loss, _ = torch_cross_entropy(
        logits,
        target.reshape(-1),
        ignore_index=self.ignore_index,
        reduction=self.reduction,
        label_smoothing=self.label_smoothing,
        logit_scale=self.logit_scale,
        logit_softcapping=self.logit_softcapping,
    )
    if self.use_l2warp:
        # fla normalises the penalty by the number of input tokens: logits viewed as [1, N, V]
        loss = L2Wrap.apply(loss, logits[None], self.l2_penalty_factor)
    return loss


def _device_dispatching(original: Callable, cpu_forward: Callable, tensor_arg: str) -> Callable:
    """A forward that calls `original` when its first tensor argument is on CUDA, else `cpu_forward`."""

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs[tensor_arg]
        if x.is_cuda:
            return original(self, *args, **kwargs)
        return cpu_forward(self, *args, **kwargs)

    forward.__name__ = original.__name__
    forward.__doc__ = original.__doc__
    forward._ccq_original = original
    return forward


# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------

_PATCHED_FUNCTIONS: list[tuple[str, str]] = [
    # (module, name): the names fla's GLA / Gated DeltaNet layers and GatedMLP call at run time
    ("fla.layers.gla", "chunk_gla"),
    ("fla.layers.gla", "fused_recurrent_gla"),
    ("fla.layers.gated_deltanet", "chunk_gated_delta_rule"),
    ("fla.layers.gated_deltanet", "fused_recurrent_gated_delta_rule"),
    ("fla.layers.gated_deltanet", "causal_conv1d"),
    ("fla.modules.mlp", "swiglu"),
    ("fla.modules.mlp", "swiglu_linear"),
]


def _patched_classes():
    from fla.modules import (
        FusedCrossEntropyLoss,
        FusedLinearCrossEntropyLoss,
        FusedRMSNormGated,
        L2Norm,
        RMSNorm,
        ShortConvolution,
    )

    return [
        (RMSNorm, _rms_norm_forward_cpu, "x"),
        (FusedRMSNormGated, _rms_norm_gated_forward_cpu, "x"),
        (ShortConvolution, _short_conv_forward_cpu, "x"),
        (L2Norm, _l2norm_forward_cpu, "x"),
        (FusedCrossEntropyLoss, _cross_entropy_forward_cpu, "input"),
        (FusedLinearCrossEntropyLoss, _linear_cross_entropy_forward_cpu, "x"),
    ]


def install() -> None:
    """Make fla's GLA / Gated DeltaNet models run on CPU; CUDA tensors still use fla's kernels.

    Patches (idempotent; safe to call many times):
    - the op names fla.layers.gla / fla.layers.gated_deltanet / fla.modules.mlp call (see
      _PATCHED_FUNCTIONS) with this module's dispatchers;
    - forward of RMSNorm, FusedRMSNormGated (and subclasses), ShortConvolution, L2Norm,
      FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss;
    - fla's ACT2FN entries swish / silu / sigmoid / logsigmoid (layers read ACT2FN when they are
      constructed, so call install() before building a model);
    - GatedMLP's powglu / powglu_linear: a clear error on CPU instead of a triton failure;
    - chunk_bwd_dqkwg in fla's gated delta rule / simple GLA (install_hopper_dqkwg_fix).
    """
    from fla.modules.activations import ops as act_ops

    for module_name, name in _PATCHED_FUNCTIONS:
        setattr(importlib.import_module(module_name), name, getattr(dispatch, name))

    mlp = importlib.import_module("fla.modules.mlp")
    for name in ("powglu", "powglu_linear"):
        original = getattr(act_ops, name)
        setattr(mlp, name, dispatch.cpu_unsupported(name, original))

    activations = (("swish", dispatch.swish), ("silu", dispatch.swish), ("sigmoid", dispatch.sigmoid),
                   ("logsigmoid", dispatch.logsigmoid))
    for key, fn in activations:
        act_ops.ACT2FN[key] = fn

    for cls, cpu_forward, tensor_arg in _patched_classes():
        current = cls.__dict__["forward"]
        original = getattr(current, "_ccq_original", current)
        cls.forward = _device_dispatching(original, cpu_forward, tensor_arg)

    install_hopper_dqkwg_fix()


def is_installed() -> bool:
    import fla.layers.gla

    return fla.layers.gla.chunk_gla is dispatch.chunk_gla
