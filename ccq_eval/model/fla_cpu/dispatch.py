"""fla's ops as device-dispatching functions: a call whose first tensor lives on CUDA goes to fla's
own function (triton, unchanged; on a machine hit by fla #640 the gated ops' backward avoids the kernel
fla refuses there, see dqkwg.py), anything else to the torch implementation of this package.

One table, `OPS`, says for every op which fla module defines it and which torch function serves it
on CPU. The torch functions take fla's argument names, so a CPU call is bound against fla's
signature (or the torch function's, where fla's is an opaque `*args, **kwargs` wrapper) and passed
on by name; arguments the torch version has no use for (`cu_seqlens_cpu`, `chunk_indices`,
`backend`) are dropped, and context parallelism (`cp_context`), which is CUDA-only, is refused.
Tensors are passed on contiguous, as fla's kernels get them, so a result never depends on strides.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from functools import cache

import torch

from ccq_eval.model.fla_cpu import delta_variants, mamba2, retention, rwkv7
from ccq_eval.model.fla_cpu.common import FlaOp
from ccq_eval.model.fla_cpu.delta_rule import (
    torch_chunk_gated_delta_rule,
    torch_fused_recurrent_gated_delta_rule,
    torch_l2norm,
)
from ccq_eval.model.fla_cpu.dqkwg import DQKWG_CALLERS as HOPPER_SAFE_OPS
from ccq_eval.model.fla_cpu.dqkwg import cuda_op
from ccq_eval.model.fla_cpu.linear_attention import (
    torch_chunk_gla,
    torch_chunk_simple_gla,
    torch_fused_recurrent_gla,
    torch_fused_recurrent_simple_gla,
)
from ccq_eval.model.fla_cpu.modules import (
    torch_causal_conv1d,
    torch_causal_conv1d_update,
    torch_logsigmoid,
    torch_rms_norm,
    torch_rms_norm_gated,
    torch_sigmoid,
    torch_swiglu,
    torch_swiglu_linear,
    torch_swish,
)

OPS: dict[str, FlaOp] = {
    "chunk_gla": FlaOp("fla.ops.gla.chunk", torch_chunk_gla),
    "fused_recurrent_gla": FlaOp("fla.ops.gla.fused_recurrent", torch_fused_recurrent_gla),
    "chunk_simple_gla": FlaOp("fla.ops.simple_gla.chunk", torch_chunk_simple_gla),
    "fused_recurrent_simple_gla": FlaOp("fla.ops.simple_gla.fused_recurrent", torch_fused_recurrent_simple_gla),
    "chunk_gated_delta_rule": FlaOp(
        "fla.ops.gated_delta_rule.chunk", torch_chunk_gated_delta_rule,
        from_kwargs=("use_gate_in_kernel", "A_log", "dt_bias"), cuda_only=("cp_context",)),
    "fused_recurrent_gated_delta_rule": FlaOp(
        "fla.ops.gated_delta_rule.fused_recurrent", torch_fused_recurrent_gated_delta_rule),
    "l2norm": FlaOp("fla.modules.l2norm", torch_l2norm),
    "causal_conv1d": FlaOp("fla.modules.causal_conv1d.ops", torch_causal_conv1d, cuda_only=("cp_context",)),
    "causal_conv1d_update": FlaOp("fla.modules.causal_conv1d.ops", torch_causal_conv1d_update),
    "rms_norm": FlaOp("fla.modules.layernorm", torch_rms_norm),
    "rms_norm_gated": FlaOp("fla.modules.fused_norm_gate", torch_rms_norm_gated),
    "swiglu": FlaOp("fla.modules.activations.ops", torch_swiglu),
    "swiglu_linear": FlaOp("fla.modules.activations.ops", torch_swiglu_linear),
    "swish": FlaOp("fla.modules.activations.ops", torch_swish),
    "sigmoid": FlaOp("fla.modules.activations.ops", torch_sigmoid),
    "logsigmoid": FlaOp("fla.modules.activations.ops", torch_logsigmoid),
}

# The families beyond GLA and Gated DeltaNet, one module each with its own OPS (and MODULE_FORWARDS, which
# backend.py reads): merged here so that one table still decides what serves every op.
FAMILY_MODULES = (delta_variants, mamba2, retention, rwkv7)
for _family in FAMILY_MODULES:
    _twice = sorted(set(OPS) & set(_family.OPS))
    if _twice:
        raise RuntimeError(f"{_family.__name__} serves ops that another table serves already: {_twice}")
    OPS.update(_family.OPS)


@cache
def fla_original(name: str) -> Callable:
    """fla's own function for op `name`, from its defining module."""
    return getattr(importlib.import_module(OPS[name].module), name)


@cache
def _cpu_signature(name: str) -> tuple[inspect.Signature, frozenset[str]]:
    """The signature a CPU call is bound against, and the torch version's parameter names."""
    torch_signature = inspect.signature(OPS[name].torch_impl)
    signature = inspect.signature(fla_original(name))
    opaque = all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values())
    return (torch_signature if opaque else signature), frozenset(torch_signature.parameters)


def _call_torch(name: str, args: tuple, kwargs: dict):
    op = OPS[name]
    signature, torch_params = _cpu_signature(name)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments, extra = {}, {}
    for pname, value in bound.arguments.items():
        kind = signature.parameters[pname].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            extra = value
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            arguments[pname] = value
    for pname in op.cuda_only:
        if arguments.get(pname, extra.get(pname)) is not None:
            raise NotImplementedError(f"{name} on CPU: context parallelism ({pname}) is CUDA-only.")
    call = {key: value for key, value in arguments.items() if key in torch_params}
    call.update({key: extra[key] for key in op.from_kwargs if key in extra})
    # Contiguous tensors, as fla's input_guard gives its kernels: a sum or matmul over a strided view
    # rounds differently from one over a contiguous tensor, so without this the result would depend
    # on the strides of the caller's views (CCQ's q~ at lambda = 0 would not give fla's bits).
    call = {key: value.contiguous() if isinstance(value, torch.Tensor) else value for key, value in call.items()}
    return op.torch_impl(**call)


def _cuda_function(name: str) -> Callable:
    """What serves op `name` on CUDA: fla's function, or on a machine hit by fla #640 the same op with a
    backward that works there (dqkwg.cuda_op)."""
    return cuda_op(name) if name in HOPPER_SAFE_OPS else fla_original(name)


# fla ops whose CUDA kernels refuse float32 inputs: under autocast their float32 inputs (a float32 model's
# activations after fla's float32 norms and convolutions) get the autocast dtype, as a matmul's would.
HALF_ONLY_INPUTS = {"chunk_delta_rule": ("q", "k", "v", "beta")}


def _autocast_inputs(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if name not in HALF_ONLY_INPUTS or not torch.is_autocast_enabled("cuda"):
        return args, kwargs
    call = inspect.signature(fla_original(name)).bind(*args, **kwargs)
    dtype = torch.get_autocast_dtype("cuda")
    for input_name in HALF_ONLY_INPUTS[name]:
        value = call.arguments.get(input_name)
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
            call.arguments[input_name] = value.to(dtype)
    return call.args, call.kwargs


@cache
def dispatcher(name: str) -> Callable:
    """Op `name` with fla's signature: fla's function on CUDA tensors, the torch version on any other device."""
    first = next(iter(inspect.signature(OPS[name].torch_impl).parameters))

    def op(*args, **kwargs):
        tensor = args[0] if args else kwargs[first]
        if tensor.is_cuda:
            args, kwargs = _autocast_inputs(name, args, kwargs)
            return _cuda_function(name)(*args, **kwargs)
        return _call_torch(name, args, kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"fla's {name} on CUDA tensors, {OPS[name].torch_impl.__name__} on any other device."
    return op


chunk_gla = dispatcher("chunk_gla")
fused_recurrent_gla = dispatcher("fused_recurrent_gla")
chunk_simple_gla = dispatcher("chunk_simple_gla")
fused_recurrent_simple_gla = dispatcher("fused_recurrent_simple_gla")
chunk_gated_delta_rule = dispatcher("chunk_gated_delta_rule")
fused_recurrent_gated_delta_rule = dispatcher("fused_recurrent_gated_delta_rule")
l2norm = dispatcher("l2norm")
causal_conv1d = dispatcher("causal_conv1d")
causal_conv1d_update = dispatcher("causal_conv1d_update")
rms_norm = dispatcher("rms_norm")
rms_norm_gated = dispatcher("rms_norm_gated")
swiglu = dispatcher("swiglu")
swiglu_linear = dispatcher("swiglu_linear")
swish = dispatcher("swish")
sigmoid = dispatcher("sigmoid")
logsigmoid = dispatcher("logsigmoid")


def cpu_unsupported(name: str, original: Callable) -> Callable:
    """`original` on CUDA; a clear error on any other device (an fla op with no torch version here)."""

    def wrapper(x, *args, **kwargs):
        if x.is_cuda:
            return original(x, *args, **kwargs)
        raise NotImplementedError(
            f"fla's {name} is triton-only and ccq_eval.model.fla_cpu has no CPU version of it; "
            "use hidden_act='swish' for GatedMLP on CPU."
        )

    return wrapper
