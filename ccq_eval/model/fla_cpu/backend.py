"""fla's GLA / Gated DeltaNet model modules on CPU, for one model at a time; fla itself is never changed.

`use_torch_backend(model)` gives each fla module of `model` a subclass of its fla class whose forward
dispatches on the device of its input: CUDA tensors run fla's own forward (triton), any other device
the torch implementations of this package. Every other fla model in the process, and fla's modules,
functions and classes, stay as they are.

Two kinds of subclass forward:
- norms, convolution, losses (`_device_forwards`): fla's forward on CUDA, a torch forward otherwise;
- layers and MLPs (`_rebound_names`): fla's own forward, run with the fla op names it calls (chunk_gla,
  swiglu, ...) bound to this package's dispatchers (`rebind`): fla's code, our name lookups.
An fla causal LM itself gets a subclass whose loss computation (fla's code) builds the losses above.
Activation functions a module took from fla's ACT2FN when it was built (a layer's gate_fn, for
instance) are replaced on that module by the dispatching ones.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from ccq_eval.model.fla_cpu import dispatch
from ccq_eval.model.fla_cpu.delta_rule import torch_l2norm
from ccq_eval.model.fla_cpu.modules import (
    torch_causal_conv1d,
    torch_causal_conv1d_update,
    torch_cross_entropy,
    torch_rms_norm,
    torch_rms_norm_gated,
)
from ccq_eval.model.fla_cpu.rebinding import rebind

# --------------------------------------------------------------------------------------------
# torch forwards of fla's norm, convolution and loss modules
# --------------------------------------------------------------------------------------------


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

    forward.__name__ = forward.__qualname__ = original.__name__
    forward.__doc__ = original.__doc__
    return forward


# --------------------------------------------------------------------------------------------
# the fla classes served, and their backend subclasses
# --------------------------------------------------------------------------------------------


@cache
def _device_forwards() -> dict[type, tuple[Callable, str]]:
    """fla module class -> (its torch forward, the name of the tensor argument that decides the device)."""
    from fla.modules import (
        FusedCrossEntropyLoss,
        FusedLinearCrossEntropyLoss,
        FusedRMSNormGated,
        L2Norm,
        RMSNorm,
        ShortConvolution,
    )

    return {
        RMSNorm: (_rms_norm_forward_cpu, "x"),
        FusedRMSNormGated: (_rms_norm_gated_forward_cpu, "x"),
        ShortConvolution: (_short_conv_forward_cpu, "x"),
        L2Norm: (_l2norm_forward_cpu, "x"),
        FusedCrossEntropyLoss: (_cross_entropy_forward_cpu, "input"),
        FusedLinearCrossEntropyLoss: (_linear_cross_entropy_forward_cpu, "x"),
    }


@cache
def _rebound_names() -> dict[type, dict[str, Callable]]:
    """fla class -> the op names its forward calls, bound to the dispatchers (fla's forward, our ops)."""
    from fla.layers.gated_deltanet import GatedDeltaNet
    from fla.layers.gla import GatedLinearAttention
    from fla.modules.activations import ops
    from fla.modules.mlp import GatedMLP, SwiGLULinear

    powglu = {name: dispatch.cpu_unsupported(name, getattr(ops, name)) for name in ("powglu", "powglu_linear")}
    return {
        GatedLinearAttention: {"chunk_gla": dispatch.chunk_gla, "fused_recurrent_gla": dispatch.fused_recurrent_gla},
        GatedDeltaNet: {
            "chunk_gated_delta_rule": dispatch.chunk_gated_delta_rule,
            "fused_recurrent_gated_delta_rule": dispatch.fused_recurrent_gated_delta_rule,
            "causal_conv1d": dispatch.causal_conv1d,
        },
        GatedMLP: {"swiglu": dispatch.swiglu, **powglu},
        SwiGLULinear: {"swiglu_linear": dispatch.swiglu_linear},
    }


def loss_on_any_device(compute_logits_and_loss: Callable) -> Callable:
    """fla's FLAForCausalLM._compute_logits_and_loss building its fused losses as backend subclasses."""
    from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss

    return rebind(compute_logits_and_loss,
                  FusedCrossEntropyLoss=torch_backend_class(FusedCrossEntropyLoss),
                  FusedLinearCrossEntropyLoss=torch_backend_class(FusedLinearCrossEntropyLoss))


def _served_base(cls: type) -> type | None:
    """The fla class in the tables whose forward `cls` runs (cls itself or a subclass that inherits it)."""
    for base in cls.__mro__:
        if base in _device_forwards() or base in _rebound_names():
            return base if cls.forward is base.forward else None
    return None


@cache
def torch_backend_class(cls: type) -> type | None:
    """The backend subclass of fla module class `cls` (same name, forward dispatching on the device),
    or None when `cls` is not served here or already is a backend class."""
    if cls.__dict__.get("_ccq_torch_backend", False):
        return None
    if _is_fla_causal_lm(cls):
        members = {"_compute_logits_and_loss": loss_on_any_device(cls._compute_logits_and_loss)}
    else:
        base = _served_base(cls)
        if base is None:
            return None
        if base in _device_forwards():
            cpu_forward, tensor_arg = _device_forwards()[base]
            forward = _device_dispatching(base.forward, cpu_forward, tensor_arg)
        else:
            forward = rebind(base.forward, **_rebound_names()[base])
        members = {"forward": forward}
    return type(cls.__name__, (cls,), {**members, "__module__": __name__, "__qualname__": cls.__qualname__,
                                       "_ccq_torch_backend": True, "__reduce_ex__": _reduce_backend_module})


def _reduce_backend_module(module: nn.Module, protocol: int):
    """Pickle a backend module by its fla class: the backend class is made anew where it is unpickled."""
    return _unpickle_backend_module, (type(module).__bases__[0], module.__getstate__())


def _unpickle_backend_module(fla_cls: type, state: dict) -> nn.Module:
    backend = torch_backend_class(fla_cls)
    module = backend.__new__(backend)
    module.__setstate__(state)
    return module


def _is_fla_causal_lm(cls: type) -> bool:
    """An fla causal LM whose loss is fla's own (a class of ours that defines its own is left alone)."""
    from fla.models.modeling_utils import FLAForCausalLM

    return (issubclass(cls, FLAForCausalLM)
            and cls._compute_logits_and_loss is FLAForCausalLM._compute_logits_and_loss)


@cache
def _activation_dispatchers() -> tuple[tuple[Callable, Callable], ...]:
    """(fla's ACT2FN function, its dispatcher) for the triton-only activations fla's modules store."""
    from fla.modules.activations import ops

    return ((ops.swish, dispatch.swish), (ops.sigmoid, dispatch.sigmoid), (ops.logsigmoid, dispatch.logsigmoid))


def _replace_activations(module: nn.Module) -> None:
    for name, value in list(vars(module).items()):
        for fla_fn, dispatcher in _activation_dispatchers():
            if value is fla_fn:
                setattr(module, name, dispatcher)


def use_torch_backend(model: nn.Module) -> nn.Module:
    """Make the fla modules of `model` (and `model` itself, when it is one) run on CPU; returns `model`.

    Changes only these objects: each served module gets its backend subclass, activations taken from
    fla's ACT2FN are replaced by dispatching ones. Parameters, buffers, state-dict names and CUDA
    behaviour stay fla's. Idempotent.
    """
    for module in model.modules():
        backend = torch_backend_class(type(module))
        if backend is not None:
            module.__class__ = backend
        _replace_activations(module)
    return model
