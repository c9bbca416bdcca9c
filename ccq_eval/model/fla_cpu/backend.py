"""fla's model modules on CPU, for one model at a time; fla itself is never changed.

`use_torch_backend(model)` gives each fla module of `model` a subclass of its fla class whose forward
dispatches on the device of its input: CUDA tensors run fla's own forward (triton), any other device
the torch implementations of this package. Every other fla model in the process, and fla's modules,
functions and classes, stay as they are.

Two kinds of subclass forward:
- norms, convolution, losses (`_device_forwards`): fla's forward on CUDA, a torch forward otherwise;
- layers and MLPs (`rebound_methods`): fla's own methods, run with the fla op names they call (chunk_gla,
  swiglu, ...) bound to this package's dispatchers (`rebind`): fla's code, our name lookups. Which methods
  and names is read off fla's code against dispatch.OPS, so a family whose ops are in that table runs.
An fla causal LM itself gets a subclass whose loss computation (fla's code) builds the losses above.
Activation functions a module took from fla's ACT2FN when it was built (a layer's gate_fn, for
instance) are replaced on that module by the dispatching ones.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from functools import cache
from types import FunctionType

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


def _device_dispatching(original: Callable, cpu_forward: Callable, tensor_arg: str,
                        torch_on_cuda: Callable[[], bool] | None = None) -> Callable:
    """A forward that calls `original` when its first tensor argument is on CUDA, else `cpu_forward`;
    `torch_on_cuda()` true sends CUDA calls to `cpu_forward` too (where fla's CUDA forward is a slow fallback)."""

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs[tensor_arg]
        if x.is_cuda and not (torch_on_cuda is not None and torch_on_cuda()):
            return original(self, *args, **kwargs)
        return cpu_forward(self, *args, **kwargs)

    forward.__name__ = forward.__qualname__ = original.__name__
    forward.__doc__ = original.__doc__
    return forward


# --------------------------------------------------------------------------------------------
# the fla classes served, and their backend subclasses
# --------------------------------------------------------------------------------------------


@cache
def _device_forwards() -> dict[type, tuple]:
    """fla module class -> (its torch forward, the name of the tensor argument that decides the device[, a
    predicate: whether CUDA calls take the torch forward too])."""
    from fla.modules import (
        FusedCrossEntropyLoss,
        FusedLinearCrossEntropyLoss,
        FusedRMSNormGated,
        L2Norm,
        RMSNorm,
        ShortConvolution,
    )

    table = {
        RMSNorm: (_rms_norm_forward_cpu, "x"),
        FusedRMSNormGated: (_rms_norm_gated_forward_cpu, "x"),
        ShortConvolution: (_short_conv_forward_cpu, "x"),
        L2Norm: (_l2norm_forward_cpu, "x"),
        FusedCrossEntropyLoss: (_cross_entropy_forward_cpu, "input"),
        FusedLinearCrossEntropyLoss: (_linear_cross_entropy_forward_cpu, "x"),
    }
    for family in dispatch.FAMILY_MODULES:
        for path, entry in family.MODULE_FORWARDS.items():
            module_name, _, class_name = path.partition(":")
            module_class = getattr(importlib.import_module(module_name), class_name)
            if module_class in table:
                raise RuntimeError(f"{family.__name__} serves {path}, which another table serves already")
            table[module_class] = entry
    return table


@cache
def _cpu_unsupported_names() -> dict[str, tuple[Callable, Callable]]:
    """name -> (fla's function, its replacement) for fla functions with no torch version here: bound where
    fla's code looks them up, so that a CPU call fails with a message naming them (CUDA calls go to fla's)."""
    from fla.modules.activations import ops

    return {name: (getattr(ops, name), dispatch.cpu_unsupported(name, getattr(ops, name)))
            for name in ("powglu", "powglu_linear")}


def names_to_bind(function: FunctionType) -> dict[str, Callable]:
    """The op names `function`'s code looks up as fla's own ops, each with what replaces it."""
    bound = {}
    for name in function.__code__.co_names:
        value = function.__globals__.get(name)
        if value is None:
            continue
        if name in dispatch.OPS and value is dispatch.fla_original(name):
            bound[name] = dispatch.dispatcher(name)
        elif name in _cpu_unsupported_names() and value is _cpu_unsupported_names()[name][0]:
            bound[name] = _cpu_unsupported_names()[name][1]
    return bound


@cache
def rebound_methods(cls: type) -> dict[str, Callable]:
    """name -> fla's method of `cls` with the op names it calls bound to the dispatchers (fla's code, our
    ops), for every method `cls` takes from an fla class whose code calls an op of dispatch.OPS. A method
    that a class outside fla overrides (a CCQ layer's forward) is left alone."""
    methods = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("fla."):
            continue
        for name, value in vars(klass).items():
            if not isinstance(value, FunctionType) or name in methods or inspect.getattr_static(cls, name) is not value:
                continue
            names = names_to_bind(value)
            if names:
                methods[name] = rebind(value, **names)
    return methods


def loss_on_any_device(compute_logits_and_loss: Callable) -> Callable:
    """fla's FLAForCausalLM._compute_logits_and_loss building its fused losses as backend subclasses."""
    from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss

    return rebind(compute_logits_and_loss,
                  FusedCrossEntropyLoss=torch_backend_class(FusedCrossEntropyLoss),
                  FusedLinearCrossEntropyLoss=torch_backend_class(FusedLinearCrossEntropyLoss))


def _device_forward_base(cls: type) -> type | None:
    """The fla class of the module table whose forward `cls` runs (cls itself or a subclass that inherits
    it), or None."""
    for base in cls.__mro__:
        if base in _device_forwards():
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
        members = dict(rebound_methods(cls))
        base = _device_forward_base(cls)
        if base is not None:
            members["forward"] = _device_dispatching(base.forward, *_device_forwards()[base])
        if not members:
            return None
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
    """An fla causal LM whose loss is fla's own: its forward computes it with fla's _compute_logits_and_loss
    (FLAForCausalLM's subclasses, and fla's Mamba family, which derives from FLAPreTrainedModel alone); a class
    of ours that defines its own loss is left alone."""
    from fla.models.modeling_utils import FLAPreTrainedModel

    return (issubclass(cls, FLAPreTrainedModel)
            and cls._compute_logits_and_loss is FLAPreTrainedModel._compute_logits_and_loss
            and "_compute_logits_and_loss" in inspect.unwrap(cls.forward).__code__.co_names)


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
