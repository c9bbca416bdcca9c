"""The CCQ read seam: one read operator that every linear-attention backbone plugs into.

A backbone (`Backbone`, one subclass per fla layer family) says, per layer:
- where r_t, the keys and the decay gamma_t come from: `read_inputs` turns the keyword arguments of one of
  the layer's kernel calls into a `KernelRead` (r, keys, scalar log decay, and the call to make);
- how the layer's kernel is called with q~ in place of q: the CCQ layer runs the backbone's forward
  (fla's own layer forward unless the backbone names another) with the names of its read kernels bound to
  `ccq_kernel_read` (fla_cpu.rebind: fla's code, our name lookups; fla itself is never changed);
- where the CCQ state (P, m, n) lives in fla's Cache: it rides on the kernel's state. The layer passes
  its cached recurrent state to the kernel as `initial_state` and caches what the kernel returns, so a
  CCQ layer's kernel call receives (S, P, m, n) and returns it (`split_state` / `join_state`): S is the
  backbone's own state, whatever the layer keeps beside it (a preconditioner's statistic, a conv state)
  stays where the layer keeps it.

The read itself is the layer's `ccq_query` (`CCQReadMixin`): q~ from r, the keys and log gamma with the
layer's gate and the CCQ config (ccq_eval.model.ccq.ccq_read_keys). With lambda = 0 q~ is r bit for bit,
so a CCQ layer reads exactly as its backbone does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn as nn

from ccq_eval.model.ccq import CCQGate, CCQState, ccq_read_keys, sigma_passes
from ccq_eval.model.fla_cpu import dispatch
from ccq_eval.model.fla_cpu.backend import names_to_bind, rebind

# What serves each read kernel a CCQ layer calls, by fla op name: fla's op on CUDA, the torch backend elsewhere.
# A table so that ccq_eval.inspection can watch the reads for the length of a `with` block; each backbone
# module adds the ops its layers read with.
READ_KERNELS: dict[str, Callable] = {}

# The CCQ layer whose forward is running in this thread / task (None: a baseline layer, which reads as its
# backbone does). The read kernels take the layer from here.
_CCQ_LAYER: ContextVar[CCQReadMixin | None] = ContextVar("ccq_layer", default=None)


class KernelRead(NamedTuple):
    """One kernel call of a backbone, as CCQ reads it."""

    r: torch.Tensor  # [B, T, H, K] the query exactly as the kernel reads it, before the kernel's scale
    keys: torch.Tensor  # [B, T, H, K] the layer's keys (CCQ scales them to unit length)
    log_decay: torch.Tensor  # [B, T, H] log gamma_t: the layer's scalar forgetting (0: none)
    keys_unit: bool  # the keys are L2-normalised already
    call: dict[str, Any]  # the kernel's keyword arguments, as the kernel is to get them (q is replaced by q~)


class Backbone:
    """How the layers of one fla family read their state, for CCQ (subclasses fill it in).

    Attributes:
        model_type: the plain fla model type of the family ("gla", ...).
        layer_class: fla's layer class.
        read_kernels: name the forward looks up -> the fla op (a key of dispatch.OPS) it calls, for every
            kernel the forward reads its state with.
        refused_kernels: fla ops (or other functions the forward looks up, such as fla's naive torch
            references) the forward may call whose read CCQ cannot condition (a form without a state to carry
            CCQ's, or one that would normalise q~ again): a CCQ layer calling one stops with an error instead of
            reading without CCQ.
    """

    model_type: ClassVar[str]
    layer_class: ClassVar[type]
    read_kernels: ClassVar[dict[str, str]]
    refused_kernels: ClassVar[tuple[str, ...]] = ()

    def forward_function(self) -> Callable:
        """The function a CCQ layer runs as its forward, with its read kernel names bound to CCQ reads."""
        return self.layer_class.forward

    def baseline_forward(self) -> Callable | None:
        """What a layer with `ccq=False` runs, where that is not the bound forward with no CCQ layer reading
        (None)."""
        return None

    def query_shape(self, layer: nn.Module) -> tuple[int, int]:
        """(heads, key dim) of the queries CCQ conditions: the gate has one weight of key dim per head."""
        return layer.num_heads, layer.head_k_dim

    def check_layer(self, layer: nn.Module) -> None:
        """ValueError, in one line, for a layer configuration CCQ cannot read."""

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        """r, keys and log gamma of the kernel call `name` with keyword arguments `call`, and the call to
        make in its place (initial_state is set by the caller)."""
        raise NotImplementedError

    def bound_forward(self) -> Callable:
        """`forward_function()` with the op names it calls bound to the dispatchers (fla's op on CUDA, the
        torch backend elsewhere) and its read kernels to the CCQ reads."""
        function = self.forward_function()
        reads = {name: ccq_kernel_read(self, name) for name in self.read_kernels}
        refused = {name: refuse_for_ccq(name, dispatch.dispatcher(name) if name in dispatch.OPS
                                        else function.__globals__[name]) for name in self.refused_kernels}
        return rebind(function, **{**names_to_bind(function), **reads, **refused})


def split_state(recurrent_state) -> tuple[Any, CCQState | None]:
    """(the backbone's state S, CCQState | None) from the state a CCQ layer's kernel call was given: (S, P, m, n)
    as a previous call returned it, or None."""
    if recurrent_state is None:
        return None, None
    S, P, m, n = recurrent_state
    return S, CCQState(P, m, n)


def join_state(backbone_state, ccq_state: CCQState) -> tuple:
    """What a CCQ layer's kernel call returns as its final state: (S, P, m, n)."""
    return (backbone_state, *ccq_state)


def reject_varlen(cu_seqlens) -> None:
    if cu_seqlens is not None:
        raise ValueError(
            "CCQ layers do not support padded batches (attention_mask with padding) or cu_seqlens: "
            "evaluate sequences one at a time or in batches of equal length without padding."
        )


def ccq_kernel_read(backbone: Backbone, name: str) -> Callable:
    """The kernel `name` of `backbone`'s forward as a CCQ layer calls it: without a CCQ layer reading, the op
    itself; with one, q -> q~ (`read_inputs`, the layer's `ccq_query`) and the (S, P, m, n) state."""
    op = backbone.read_kernels[name]
    signature = inspect.signature(dispatch.OPS[op].torch_impl)

    def read(*args, **call):
        if args:  # a caller passing q, k, v by position (ccq-eval's own Mamba2 forward)
            call = dict(signature.bind_partial(*args, **call).arguments)
        kernel = READ_KERNELS[op]
        layer = _CCQ_LAYER.get()
        if layer is None:
            return kernel(**call)
        reject_varlen(call.get("cu_seqlens"))
        S, ccq_state = split_state(call.get("initial_state"))
        inputs = backbone.read_inputs(name, call)
        q, ccq_state = layer.ccq_query(inputs.r, inputs.keys, inputs.log_decay, ccq_state, keys_unit=inputs.keys_unit)
        kernel_call = {**inputs.call, "q": q}
        if "initial_state" in call:
            kernel_call["initial_state"] = S
        out = kernel(**kernel_call)
        if not call.get("output_final_state", False):
            return out
        o, final, *rest = out
        return (o, join_state(final, ccq_state), *rest)

    read.__name__ = read.__qualname__ = name
    return read


def refuse_for_ccq(name: str, original: Callable) -> Callable:
    """`original` for a baseline layer; a clear error where a CCQ layer would call it (a kernel whose read
    CCQ does not condition, so a CCQ layer would silently read without it)."""

    def kernel(*args, **kwargs):
        if _CCQ_LAYER.get() is not None:
            raise ValueError(f"CCQ layers cannot read with {name}; choose the layer's chunk or recurrent mode")
        return original(*args, **kwargs)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def serve_reads(*ops: str) -> None:
    """Put fla ops `ops` in READ_KERNELS (their dispatchers), for the backbones that read with them."""
    for op in ops:
        READ_KERNELS.setdefault(op, dispatch.dispatcher(op))


def same_dtype_float(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32: the precision a log decay is formed in."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class CCQReadMixin:
    """What every CCQ layer adds to its fla layer: the gate parameters, the read q -> q~, and a forward that
    runs its backbone's (`_fla_forward`: Backbone.bound_forward) with this layer as the one reading.
    A class using it sets `ccq_backbone` and `_fla_forward`."""

    ccq_backbone: ClassVar[Backbone]
    _fla_forward: ClassVar[Callable]

    def attach_ccq(self, config) -> None:
        self.ccq_enabled = config.ccq
        self.ccq_order = config.ccq_order
        self.ccq_centered = config.ccq_centered
        self.ccq_decay = config.ccq_decay
        self.ccq_gate = config.ccq_gate
        self.ccq_lambda_max = config.ccq_lambda_max
        self.ccq_gate_bias_init = config.ccq_gate_bias_init
        self.ccq_form = config.ccq_form
        self.ccq_solve_steps = config.ccq_solve_steps
        if not self.ccq_enabled:
            return  # a baseline: the backbone's forward and parameters, nothing extra to save or load
        self.ccq_backbone.check_layer(self)
        heads, dim = self.ccq_backbone.query_shape(self)
        device = next(self.parameters()).device
        self.ccq_gate_weight = nn.Parameter(torch.zeros(heads, dim, device=device))
        self.ccq_gate_bias = nn.Parameter(torch.full((heads,), self.ccq_gate_bias_init, device=device))

    def reset_ccq_parameters(self) -> None:
        """Initial values for CCQ parameters a checkpoint did not provide (e.g. a plain fla checkpoint)."""
        if not self.ccq_enabled:
            return
        with torch.no_grad():
            if not getattr(self.ccq_gate_weight, "_is_hf_initialized", False):
                self.ccq_gate_weight.zero_()
            if not getattr(self.ccq_gate_bias, "_is_hf_initialized", False):
                self.ccq_gate_bias.fill_(self.ccq_gate_bias_init)

    def ccq_read_gate(self) -> CCQGate:
        """lambda_t = lambda_max * sigmoid(a_h . r_t + b_h) ("query") or lambda_max * sigmoid(b_h)."""
        weight = None if self.ccq_gate == "constant" else self.ccq_gate_weight
        return CCQGate(weight, self.ccq_gate_bias, self.ccq_lambda_max)

    def ccq_query(self, r, k, log_decay, ccq_state: CCQState | None, keys_unit: bool = False):
        """q~ for the backbone's read; log_decay [B, T, H] is the layer's scalar log forgetting;
        keys_unit: k is L2-normalised already (ccq.ccq_read_keys)."""
        if self.ccq_decay == "none":
            log_decay = torch.zeros_like(log_decay)
        order = sigma_passes(self.ccq_form, self.ccq_order, self.ccq_solve_steps)
        return ccq_read_keys(r, k, log_decay, self.ccq_read_gate(), order=order, centered=self.ccq_centered,
                             initial_state=ccq_state, keys_unit=keys_unit, form=self.ccq_form)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, **kwargs):
        """The backbone's forward, whose kernel calls read with q~ when CCQ is on."""
        if not self.ccq_enabled:
            baseline = self.ccq_backbone.baseline_forward()
            if baseline is not None:
                return baseline(self, hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                                **kwargs)
        if self.ccq_enabled:
            attention_mask = without_trivial_mask(attention_mask)
        token = _CCQ_LAYER.set(self if self.ccq_enabled else None)
        try:
            return self._fla_forward(hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                                     **kwargs)
        finally:
            _CCQ_LAYER.reset(token)


def without_trivial_mask(attention_mask):
    """An all-ones mask (what lm-eval's HFLM always passes) pads nothing: drop it, or fla would pack the
    batch into variable-length form, which CCQ layers do not support."""
    if attention_mask is not None and bool(attention_mask.all()):
        return None
    return attention_mask
