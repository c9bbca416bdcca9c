"""CCQ-GLA and CCQ-Gated-DeltaNet: fla's models with the Curvature-Conditioned Query on the read.

The classes extend fla 0.6.0's GLA and Gated DeltaNet. Every fla layer keeps its parameters and names;
a CCQ layer adds two per head (gate weight a_h [H, K] at 0, gate bias b_h [H] at ccq_gate_bias_init), so
every fla checkpoint loads with the CCQ parameters at their initial values. With `ccq=False` a layer
runs fla's own forward, so the logits are fla's. Only the read changes: the kernels get q~ in place of
the query; keys, values, gates and the write are untouched (../shared/design/ccq.md).

The recurrent state of a CCQ layer in fla's Cache is the tuple (S, P, m, n): the backbone state, then
the CCQ covariance state (see ccq_eval.model.ccq.CCQState).
"""

from __future__ import annotations

import logging
import tarfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat
from fla.layers import gated_deltanet as fla_gdn_layer
from fla.layers import gla as fla_gla_layer
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.layers.gla import GatedLinearAttention
from fla.layers.utils import get_layer_cache, repad_hidden_states, unpad_hidden_states, update_layer_cache
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM
from transformers import AutoConfig, AutoModelForCausalLM

from ccq_eval.model import fla_cpu
from ccq_eval.model.ccq import CCQ_FORMS, CCQGate, CCQState, ccq_read_keys, sigma_passes
from ccq_eval.model.kernels import autotune
from ccq_eval.model.kernels.l2norm_pair import l2norm_pair

logger = logging.getLogger(__name__)

CCQ_DECAYS = ("state", "none")
CCQ_GATES = ("query", "constant")


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


class CCQConfigMixin:
    """The CCQ fields of ccq.md, validated when a config is built or loaded.

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
    """What both CCQ layers add to their fla layer: the gate parameters and the read q -> q~."""

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

    def short_conv_qkv(self, hidden_states, last_state, use_cache):
        """q, k, v through the layer's short convolutions, continuing from the cached conv states."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        if last_state is None and not use_cache and _same_convolutions(convs):
            # No state in or out: one depthwise convolution over the q, k, v channels side by side,
            # as fla's GatedDeltaNet does for its baseline. Each channel is computed as with three
            # calls; one call saves host time, which bounds the forward of mid-size models on a GPU.
            projected = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states),
                                   self.v_proj(hidden_states)], dim=-1)
            weight = torch.cat([conv.weight.squeeze(1) for conv in convs], dim=0)
            bias = None if convs[0].bias is None else torch.cat([conv.bias for conv in convs], dim=0)
            mixed, _ = fla_cpu.causal_conv1d(x=projected, weight=weight, bias=bias,
                                             activation=convs[0].activation, backend=convs[0].backend)
            widths = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
            return (*torch.split(mixed, widths, dim=-1), (None, None, None))
        states = last_state["conv_state"] if last_state is not None else (None, None, None)
        outputs, new_states = [], []
        for proj, conv, state in zip((self.q_proj, self.k_proj, self.v_proj),
                                     (self.q_conv1d, self.k_conv1d, self.v_conv1d), states):
            x, state = conv(x=proj(hidden_states), cache=state, output_final_state=use_cache)
            outputs.append(x)
            new_states.append(state)
        return (*outputs, tuple(new_states))

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


def _same_convolutions(convs) -> bool:
    """Whether short convolutions can run as one over their concatenated channels (fla's condition for
    its fused q, k, v convolution: the same backend, activation and kernel size, biases on all or none)."""
    first = convs[0]
    return all(conv.backend == first.backend and conv.activation == first.activation
               and conv.kernel_size == first.kernel_size and (conv.bias is None) == (first.bias is None)
               for conv in convs)


def _split_state(last_state):
    """(S, CCQState | None) from a layer cache entry written by a CCQ layer (or nothing yet)."""
    if last_state is None or last_state.get("recurrent_state") is None:
        return None, None
    S, P, m, n = last_state["recurrent_state"]
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


class CCQGatedLinearAttention(CCQReadMixin, GatedLinearAttention):
    """fla's GatedLinearAttention, reading its state with q~. GLA's decay for CCQ: exp(mean_j gk[j])."""

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, **kwargs):
        if not self.ccq_enabled:
            return GatedLinearAttention.forward(self, hidden_states, attention_mask, past_key_values, use_cache,
                                                output_attentions, **kwargs)
        batch_size, q_len, _ = hidden_states.shape
        attention_mask = _without_trivial_mask(attention_mask)
        mode = "fused_recurrent" if q_len <= 64 else self.mode
        last_state = get_layer_cache(self, past_key_values)
        hidden_states, indices, cu_seqlens = unpad_hidden_states(
            hidden_states, kwargs.get("cu_seqlens"), attention_mask, q_len)
        _reject_varlen(cu_seqlens)

        conv_states = None
        if self.use_short_conv:
            q, k, v, conv_states = self.short_conv_qkv(hidden_states, last_state, use_cache)
        else:
            q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        gk = self.gk_proj(hidden_states)

        q = rearrange(q, "... (h d) -> ... h d", d=self.head_k_dim)
        if self.num_kv_groups > 1:
            k, gk = (repeat(x, "... (h d) -> ... (h g) d", g=self.num_kv_groups, d=self.head_k_dim) for x in (k, gk))
            v = repeat(v, "... (h d) -> ... (h g) d", g=self.num_kv_groups, d=self.head_v_dim)
        else:
            k, gk = (rearrange(x, "... (h d) -> ... h d", d=self.head_k_dim) for x in (k, gk))
            v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        gk = F.logsigmoid(gk) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = torch.clamp_min(gk, self.clamp_min)
        if self.feature_map_fn is not None:
            q, k = map(self.feature_map_fn, (q, k))

        S, ccq_state = _split_state(last_state)
        # Geometric mean of the channel decays: a scalar keeps Sigma symmetric (ccq.md).
        q, ccq_state = self.ccq_query(q, k, gk.mean(-1, dtype=torch.float32), ccq_state)

        # The module attributes, not imported names: the CPU backend patches them.
        if mode == "fused_recurrent":
            o, S = fla_gla_layer.fused_recurrent_gla(q=q, k=k, v=v, gk=gk, initial_state=S,
                                                     output_final_state=use_cache, state_v_first=True)
        else:
            o, S = fla_gla_layer.chunk_gla(q=q, k=k, v=v, g=gk, initial_state=S,
                                           output_final_state=use_cache, state_v_first=True)

        update_layer_cache(
            self, past_key_values,
            recurrent_state=(S, *ccq_state) if use_cache else None,
            conv_state=conv_states,
            offset=q_len,
        )
        if self.use_output_gate:
            g = self.g_proj(hidden_states)
            if self.fuse_norm_and_gate:
                g = rearrange(g, "... (h d) -> ... h d", d=self.head_v_dim)
                o = rearrange(self.g_norm_swish_gate(o, g), "... h d -> ... (h d)")
            else:
                o = rearrange(self.g_norm(o), "... h d -> ... (h d)") * self.gate_fn(g)
        else:
            o = rearrange(self.g_norm(o), "... h d -> ... (h d)")
        o = repad_hidden_states(self.o_proj(o), indices, batch_size, q_len)
        return o, None, past_key_values


class CCQGatedDeltaNet(CCQReadMixin, GatedDeltaNet):
    """fla's GatedDeltaNet reading with q~. q and k are L2-normalised here (not in the kernel) so that
    CCQ sees the query the read uses; CCQ's decay is the layer's own exp(g_t)."""

    def attach_ccq(self, config) -> None:
        if self.num_v_heads != self.num_heads:
            raise ValueError(
                f"CCQ needs num_v_heads == num_heads (got {self.num_v_heads} and {self.num_heads}): "
                "grouped value heads have several decays per key head. Set ccq=false for this model."
            )
        super().attach_ccq(config)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, **kwargs):
        if not self.ccq_enabled:
            return GatedDeltaNet.forward(self, hidden_states, attention_mask, past_key_values, use_cache,
                                         output_attentions, **kwargs)
        batch_size, q_len, _ = hidden_states.shape
        attention_mask = _without_trivial_mask(attention_mask)
        if torch.is_grad_enabled() or self.training:
            mode = "chunk"
        elif q_len <= 64:
            mode = "fused_recurrent"
        else:
            mode = self.mode
        last_state = get_layer_cache(module=self, past_key_values=past_key_values)
        hidden_states, indices, cu_seqlens = unpad_hidden_states(
            hidden_states=hidden_states, cu_seqlens=kwargs.get("cu_seqlens"), attention_mask=attention_mask,
            q_len=q_len)
        _reject_varlen(cu_seqlens)

        conv_states = None
        if self.use_short_conv:
            q, k, v, conv_states = self.short_conv_qkv(hidden_states, last_state, use_cache)
        else:
            q, k, v = (F.silu(proj(hidden_states)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (rearrange(x, "... (h d) -> ... h d", d=self.head_k_dim) for x in (q, k))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        # q and k normalised together, read from their strided views (one Triton launch on CUDA, no
        # torch.stack copy: ccq_eval/model/kernels/l2norm_pair.py); each comes out contiguous.
        q, k = l2norm_pair(q, k)

        a = self.a_proj(hidden_states)
        beta = self.b_proj(hidden_states)
        # The kernel's own gate: g = -exp(A_log) * softplus(a + dt_bias), per head, fp32.
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        S, ccq_state = _split_state(last_state)
        q, ccq_state = self.ccq_query(q, k, log_decay, ccq_state, keys_unit=True)

        kernel = (fla_gdn_layer.chunk_gated_delta_rule if mode == "chunk"
                  else fla_gdn_layer.fused_recurrent_gated_delta_rule)
        o, S = kernel(
            q=q, k=k, v=v, g=a, beta=beta, initial_state=S, output_final_state=use_cache,
            use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval, state_v_first=True,
            use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
        )
        update_layer_cache(
            module=self, past_key_values=past_key_values,
            recurrent_state=(S, *ccq_state) if use_cache else None,
            conv_state=conv_states,
            offset=q_len,
        )
        if self.use_gate:
            g = rearrange(self.g_proj(hidden_states), "... (h d) -> ... h d", d=self.head_v_dim)
            o = self.o_norm(o, g)
        else:
            o = self.o_norm(o)
        o = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        o = repad_hidden_states(hidden_states=o, indices=indices, batch_size=batch_size, q_len=q_len)
        return o, None, past_key_values


class CCQCausalLMMixin:
    """Turns the fla layers of a freshly built model into CCQ layers, and fixes generate()'s cache name."""

    _ccq_layer_types: dict[type, type] = {}

    def _attach_ccq_layers(self, config) -> None:
        for block in self.model.layers:
            layer = getattr(block, "attn", None)
            ccq_type = self._ccq_layer_types.get(type(layer))
            if ccq_type is not None:
                # The fla layer keeps its submodules and parameter names; only its class changes.
                layer.__class__ = ccq_type
                layer.attach_ccq(config)

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
    _ccq_layer_types = {GatedLinearAttention: CCQGatedLinearAttention}

    def __init__(self, config: CCQGLAConfig):
        prepare_runtime()  # fla's layers read its activation table when built
        super().__init__(config)
        self._attach_ccq_layers(config)


class CCQGatedDeltaNetForCausalLM(CCQCausalLMMixin, GatedDeltaNetForCausalLM):
    config_class = CCQGatedDeltaNetConfig
    _ccq_layer_types = {GatedDeltaNet: CCQGatedDeltaNet}

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
    """Make this process ready for the CCQ models (idempotent): the cap on triton's autotuning
    (CCQ_EVAL_AUTOTUNE_CONFIGS) and, with CUDA, the shipped autotune winners in triton's cache
    (kernels/autotune.py), fla's CPU backend (`fla_cpu.install`) and the model types in
    transformers' Auto classes. The loader, the lm-eval adapter and the models' constructors call
    it; importing ccq_eval does not.
    """
    autotune.install_limit_from_env()
    global _winners_seeded
    if not _winners_seeded and torch.cuda.is_available():
        try:
            autotune.seed_tuned_winners()
        except (OSError, tarfile.TarError) as error:  # a read-only cache: kernels autotune as usual
            logger.warning("could not copy the shipped autotune winners into triton's cache: %s", error)
        _winners_seeded = True
    fla_cpu.install()
    register()
