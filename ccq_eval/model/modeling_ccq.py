"""CCQ-GLA and CCQ-Gated-DeltaNet: fla's models with the Curvature-Conditioned Query on the read.

The classes extend fla 0.6.0's GLA and Gated DeltaNet. Every fla layer keeps its parameters and names;
a CCQ layer adds two per head (gate weight a_h [H, K] at 0, gate bias b_h [H] at ccq_gate_bias_init), so
every fla checkpoint loads with the CCQ parameters at their initial values. With `ccq=False` a layer
runs fla's own forward, so the logits are fla's. Only the read changes: the kernels get q~ in place of
the query; keys, values, gates and the write are untouched (docs/operator.md).

The recurrent state of a CCQ layer in fla's Cache is the tuple (S, P, m, n): the backbone state, then
the CCQ covariance state (see ccq_eval.model.ccq.CCQState).
"""

from __future__ import annotations

import logging
import tarfile
from collections.abc import Callable
from contextvars import ContextVar
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.layers.gla import GatedLinearAttention
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM
from fla.models.modeling_utils import FLAForCausalLM
from transformers import AutoConfig, AutoModelForCausalLM

from ccq_eval.model import fla_cpu
from ccq_eval.model.ccq import CCQ_FORMS, CCQGate, CCQState, ccq_read_keys, sigma_passes
from ccq_eval.model.fla_cpu.backend import rebind
from ccq_eval.model.kernels import autotune
from ccq_eval.model.kernels.l2norm_pair import l2norm_pair

logger = logging.getLogger(__name__)

CCQ_DECAYS = ("state", "none")
CCQ_GATES = ("query", "constant")


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


class CCQConfigMixin:
    """The CCQ fields of docs/operator.md, validated when a config is built or loaded.

    ccq_form selects the read operator: "series" (default) q~ = sum_{j=0..R} (-lambda Sigma)^j r with
    R = ccq_order; "resolvent" q~ = (I + lambda Sigma)^-1 r, solved by ccq_solve_steps conjugate-gradient
    steps on the same (P, m, n) state. Each form has its own count because they mean different things:
    a series order is the degree of a fixed polynomial whose useful range depends on lambda (it diverges
    as R grows once lambda s_max > 1), while solver steps only buy accuracy towards one fixed operator:
    exact after head_k_dim steps (in exact arithmetic), and after S steps an error in the
    (I + lambda Sigma)-norm of at most 2 ((sqrt(c) - 1) / (sqrt(c) + 1))^S of the solution's,
    c = 1 + ccq_lambda_max. The default of 4 steps is well inside bf16 precision at ccq_lambda_max = 4:
    a unit-key covariance has trace <= 1, so few eigenvalues are large and CG converges much faster than
    that bound; raise it for large ccq_lambda_max. Both forms cost one Sigma application (a d_k-wide
    linear-attention pass) per order or step. The field not selected is stored but unused. A config
    without ccq_form reads as "series". The fused Triton kernels cover the series form of order 1
    only; the resolvent runs the unfused paths.
    """

    def _init_ccq(
        self,
        ccq: bool = True,
        ccq_order: int = 1,
        ccq_centered: bool = True,
        ccq_decay: str = "state",
        ccq_gate: str = "query",
        ccq_lambda_max: float = 4.0,
        ccq_gate_bias_init: float = 0.0,
        ccq_form: str = "series",
        ccq_solve_steps: int = 4,
    ) -> None:
        problems = []
        if not _positive_int(ccq_order):
            problems.append(f"ccq_order must be an integer >= 1, got {ccq_order!r}")
        if ccq_form not in CCQ_FORMS:
            problems.append(f"ccq_form must be one of {CCQ_FORMS}, got {ccq_form!r}")
        if not _positive_int(ccq_solve_steps):
            problems.append(f"ccq_solve_steps must be an integer >= 1, got {ccq_solve_steps!r}")
        if not isinstance(ccq_lambda_max, (int, float)) or not ccq_lambda_max > 0:
            problems.append(f"ccq_lambda_max must be a number > 0, got {ccq_lambda_max!r}")
        if ccq_decay not in CCQ_DECAYS:
            problems.append(f"ccq_decay must be one of {CCQ_DECAYS}, got {ccq_decay!r}")
        if ccq_gate not in CCQ_GATES:
            problems.append(f"ccq_gate must be one of {CCQ_GATES}, got {ccq_gate!r}")
        if problems:
            raise ValueError(f"invalid CCQ configuration ({type(self).__name__}): " + "; ".join(problems))
        self.ccq = bool(ccq)
        self.ccq_order = ccq_order
        self.ccq_centered = bool(ccq_centered)
        self.ccq_decay = ccq_decay
        self.ccq_gate = ccq_gate
        self.ccq_lambda_max = float(ccq_lambda_max)
        self.ccq_gate_bias_init = float(ccq_gate_bias_init)
        self.ccq_form = ccq_form
        self.ccq_solve_steps = ccq_solve_steps


def _pop_ccq_kwargs(kwargs: dict) -> dict:
    names = ("ccq", "ccq_order", "ccq_centered", "ccq_decay", "ccq_gate", "ccq_lambda_max",
             "ccq_gate_bias_init", "ccq_form", "ccq_solve_steps")
    return {name: kwargs.pop(name) for name in names if name in kwargs}


class CCQGLAConfig(CCQConfigMixin, GLAConfig):
    model_type = "ccq_gla"

    def __init__(self, **kwargs):
        ccq_kwargs = _pop_ccq_kwargs(kwargs)
        # fla 0.6.0 removed the fused_chunk kernel; "chunk" computes the same thing.
        if kwargs.get("attn_mode") == "fused_chunk":
            kwargs["attn_mode"] = "chunk"
        super().__init__(**kwargs)
        self._init_ccq(**ccq_kwargs)


class CCQGatedDeltaNetConfig(CCQConfigMixin, GatedDeltaNetConfig):
    model_type = "ccq_gated_deltanet"

    def __init__(self, **kwargs):
        ccq_kwargs = _pop_ccq_kwargs(kwargs)
        super().__init__(**kwargs)
        self._init_ccq(**ccq_kwargs)


class CCQReadMixin:
    """What both CCQ layers add to their fla layer: the gate parameters, the read q -> q~, and a forward
    that runs fla's own (the class's `_fla_forward`, fla's code with its kernel names bound to the
    CCQ reads below) with this layer as the one reading."""

    def attach_ccq(self, config: CCQConfigMixin) -> None:
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
            return  # a baseline: fla's forward, fla's parameters, nothing extra to save or load
        heads, dim = self.num_heads, self.head_k_dim
        device = self.q_proj.weight.device
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
        """fla's forward of the layer (`_fla_forward`), whose kernel calls read with q~ when CCQ is on."""
        if self.ccq_enabled:
            attention_mask = _without_trivial_mask(attention_mask)
        token = _CCQ_LAYER.set(self if self.ccq_enabled else None)
        try:
            return self._fla_forward(hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                                     **kwargs)
        finally:
            _CCQ_LAYER.reset(token)


# The CCQ layer whose forward is running in this thread / task (None: a baseline layer, fla's read). The
# layers run fla's own forward; the kernel names it calls are bound to the functions below, which take
# the layer from here. Nothing in fla is changed.
_CCQ_LAYER: ContextVar[CCQReadMixin | None] = ContextVar("ccq_layer", default=None)

# What serves each kernel name fla's layer forwards call: fla's op on CUDA, the torch backend elsewhere.
# A table so that ccq_eval.inspection can watch the reads for the length of a `with` block.
READ_KERNELS: dict[str, Callable] = {
    "chunk_gla": fla_cpu.chunk_gla,
    "fused_recurrent_gla": fla_cpu.fused_recurrent_gla,
    "chunk_gated_delta_rule": fla_cpu.chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": fla_cpu.fused_recurrent_gated_delta_rule,
}


def _split_state(recurrent_state):
    """(S, CCQState | None) from a recurrent state written by a CCQ layer (or nothing yet)."""
    if recurrent_state is None:
        return None, None
    S, P, m, n = recurrent_state
    return S, CCQState(P, m, n)


def _without_trivial_mask(attention_mask):
    """An all-ones mask (what lm-eval's HFLM always passes) pads nothing: drop it, or fla would pack the
    batch into variable-length form, which CCQ layers do not support."""
    if attention_mask is not None and bool(attention_mask.all()):
        return None
    return attention_mask


def _reject_varlen(cu_seqlens):
    if cu_seqlens is not None:
        raise ValueError(
            "CCQ layers do not support padded batches (attention_mask with padding) or cu_seqlens: "
            "evaluate sequences one at a time or in batches of equal length without padding."
        )


def _gla_read(name: str) -> Callable:
    """GLA kernel `name` as a CCQ layer calls it: CCQ turns q into q~ and keeps (P, m, n) beside the
    backbone state S in the layer's recurrent state. GLA's decay for CCQ: exp(mean_j gk[j]), the
    geometric mean of the channel decays (a scalar keeps Sigma symmetric, docs/operator.md)."""

    def read(*, q, k, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
        kernel = READ_KERNELS[name]
        layer = _CCQ_LAYER.get()
        if layer is None:
            return kernel(q=q, k=k, initial_state=initial_state, output_final_state=output_final_state,
                          cu_seqlens=cu_seqlens, **kwargs)
        _reject_varlen(cu_seqlens)
        S, ccq_state = _split_state(initial_state)
        log_gate = kwargs["g"] if "g" in kwargs else kwargs["gk"]  # chunk_gla: g, fused_recurrent_gla: gk
        q, ccq_state = layer.ccq_query(q, k, log_gate.mean(-1, dtype=torch.float32), ccq_state)
        o, S = kernel(q=q, k=k, initial_state=S, output_final_state=output_final_state, **kwargs)
        return o, ((S, *ccq_state) if output_final_state else None)

    read.__name__ = read.__qualname__ = name
    return read


def _gated_delta_read(name: str) -> Callable:
    """Gated DeltaNet kernel `name` as a CCQ layer calls it. q and k are L2-normalised and the decay
    g = -exp(A_log) softplus(a + dt_bias) computed here, as the kernel would, so that CCQ sees the query
    the read uses and decays with the layer's own exp(g_t); the kernel then reads q~ without
    normalising it again."""

    def read(*, q, k, g, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             cu_seqlens=None, **kwargs):
        kernel = READ_KERNELS[name]
        layer = _CCQ_LAYER.get()
        if layer is None:
            return kernel(q=q, k=k, g=g, initial_state=initial_state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, **kwargs)
        _reject_varlen(cu_seqlens)
        if not (use_qk_l2norm_in_kernel and kwargs.get("use_gate_in_kernel")):
            raise RuntimeError(
                f"CCQ: fla's GatedDeltaNet calls {name} without use_qk_l2norm_in_kernel / use_gate_in_kernel; "
                "the installed fla differs from the one ccq-eval was written against (pyproject.toml pins it).")
        # q and k normalised together, read from their strided views (one Triton launch on CUDA, no
        # torch.stack copy: ccq_eval/model/kernels/l2norm_pair.py); each comes out contiguous.
        q, k = l2norm_pair(q, k)
        A_log, dt_bias = kwargs["A_log"], kwargs["dt_bias"]
        log_decay = -A_log.float().exp() * F.softplus(g.float() + dt_bias.float())
        S, ccq_state = _split_state(initial_state)
        q, ccq_state = layer.ccq_query(q, k, log_decay, ccq_state, keys_unit=True)
        o, S = kernel(q=q, k=k, g=g, initial_state=S, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=False, **kwargs)
        return o, ((S, *ccq_state) if output_final_state else None)

    read.__name__ = read.__qualname__ = name
    return read


class CCQGatedLinearAttention(CCQReadMixin, GatedLinearAttention):
    """fla's GatedLinearAttention, reading its state with q~ (fla's forward, CCQ in its kernel calls)."""

    _fla_forward = rebind(GatedLinearAttention.forward, chunk_gla=_gla_read("chunk_gla"),
                          fused_recurrent_gla=_gla_read("fused_recurrent_gla"))


class CCQGatedDeltaNet(CCQReadMixin, GatedDeltaNet):
    """fla's GatedDeltaNet reading with q~ (fla's forward, CCQ in its kernel calls)."""

    _fla_forward = rebind(
        GatedDeltaNet.forward,
        chunk_gated_delta_rule=_gated_delta_read("chunk_gated_delta_rule"),
        fused_recurrent_gated_delta_rule=_gated_delta_read("fused_recurrent_gated_delta_rule"),
        causal_conv1d=fla_cpu.causal_conv1d,
    )

    def attach_ccq(self, config) -> None:
        if self.num_v_heads != self.num_heads:
            raise ValueError(
                f"CCQ needs num_v_heads == num_heads (got {self.num_v_heads} and {self.num_heads}): "
                "grouped value heads have several decays per key head. Set ccq=false for this model."
            )
        super().attach_ccq(config)


class CCQCausalLMMixin:
    """Turns the fla layers of a freshly built model into CCQ layers and its other fla modules into ones
    that also run on CPU (fla_cpu.use_torch_backend), and fixes generate()'s cache name."""

    _ccq_layer_types: ClassVar[dict[type, type]] = {}

    # fla's loss computation, building its fused losses as classes that also run on CPU
    _compute_logits_and_loss = fla_cpu.backend.loss_on_any_device(FLAForCausalLM._compute_logits_and_loss)

    def _attach_ccq_layers(self, config) -> None:
        for block in self.model.layers:
            layer = getattr(block, "attn", None)
            ccq_type = self._ccq_layer_types.get(type(layer))
            if ccq_type is not None:
                # The fla layer keeps its submodules and parameter names; only its class changes.
                layer.__class__ = ccq_type
                layer.attach_ccq(config)
        fla_cpu.use_torch_backend(self)

    def _initialize_missing_keys(self, *args, **kwargs):
        # fla's _init_weights (run per sub-model, so not overridable here) does not know the CCQ
        # parameters: give those the checkpoint lacked their initial values after transformers' pass.
        super()._initialize_missing_keys(*args, **kwargs)
        for module in self.modules():
            if isinstance(module, CCQReadMixin):
                module.reset_ccq_parameters()

    def forward(self, *args, cache=None, **kwargs):
        # transformers >= 5.2x's generate() passes the recurrent cache as `cache`, which fla 0.6.0 ignores
        # (it reads `past_key_values`): decoding would then restart from an empty state every step.
        if cache is not None and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = cache
        return super().forward(*args, **kwargs)


class CCQGLAForCausalLM(CCQCausalLMMixin, GLAForCausalLM):
    config_class = CCQGLAConfig
    _ccq_layer_types: ClassVar[dict[type, type]] = {GatedLinearAttention: CCQGatedLinearAttention}

    def __init__(self, config: CCQGLAConfig):
        prepare_runtime()
        super().__init__(config)
        self._attach_ccq_layers(config)


class CCQGatedDeltaNetForCausalLM(CCQCausalLMMixin, GatedDeltaNetForCausalLM):
    config_class = CCQGatedDeltaNetConfig
    _ccq_layer_types: ClassVar[dict[type, type]] = {GatedDeltaNet: CCQGatedDeltaNet}

    def __init__(self, config: CCQGatedDeltaNetConfig):
        prepare_runtime()
        super().__init__(config)
        self._attach_ccq_layers(config)


def register() -> None:
    """Make the model types known to transformers' Auto classes (idempotent)."""
    for config_cls, model_cls in ((CCQGLAConfig, CCQGLAForCausalLM),
                                  (CCQGatedDeltaNetConfig, CCQGatedDeltaNetForCausalLM)):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


_winners_seeded = False  # prepare_runtime copies the shipped autotune winners once per process


def prepare_runtime() -> None:
    """Make this process ready for the CCQ models (idempotent): with CUDA, the shipped autotune winners
    in triton's cache (kernels/autotune.py), and the model types in transformers' Auto classes. fla is
    left as it is: the CCQ classes run on CPU through their own modules (fla_cpu.use_torch_backend), and
    on CUDA fla's kernels autotune as triton and fla decide. The loader, the
    lm-eval adapter and the models' constructors call it; importing ccq_eval does not.
    """
    global _winners_seeded
    if not _winners_seeded and torch.cuda.is_available():
        try:
            autotune.seed_tuned_winners()
        except (OSError, tarfile.TarError) as error:  # a read-only cache: kernels autotune as usual
            logger.warning("could not copy the shipped autotune winners into triton's cache: %s", error)
        _winners_seeded = True
    register()
