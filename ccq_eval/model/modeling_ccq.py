"""The CCQ model types: fla's models of every backbone CCQ attaches to (ccq_eval.model.backbones), with the
Curvature-Conditioned Query on the read.

`ccq_gla`, `ccq_gated_deltanet`, `ccq_delta_net`, `ccq_kda`, `ccq_retnet`, `ccq_mamba2` and
`ccq_precond_gated_deltanet` extend fla 0.6.0's classes of the family (CCQ_CLASSES). Every fla layer keeps
its parameters and names; a CCQ layer adds two per head (gate weight a_h [H, K] at 0, gate bias b_h [H] at
ccq_gate_bias_init), so every fla checkpoint of the family loads with the CCQ parameters at their initial
values. With `ccq=False` a layer runs its
backbone's own forward, so the logits are fla's. Only the read changes: the kernels get q~ in place of the
query; keys, values, gates and the write are untouched (docs/operator.md).

The recurrent state of a CCQ layer in fla's Cache is the tuple (S, P, m, n): the backbone state, then
the CCQ covariance state (see ccq_eval.model.ccq.CCQState and backbones.seam); a Preconditioned Gated DeltaNet
layer keeps its ATK statistic beside it, ((S, P, m, n), A), as fla's layer keeps (S, A).
"""

from __future__ import annotations

import logging
import tarfile
from typing import ClassVar

import torch
from fla.layers.delta_net import DeltaNet
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.layers.gla import GatedLinearAttention
from fla.layers.kda import KimiDeltaAttention
from fla.layers.mamba2 import Mamba2
from fla.layers.multiscale_retention import MultiScaleRetention
from fla.layers.precond_gated_deltanet import PrecondGatedDeltaNet
from fla.models import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    GatedDeltaNetConfig,
    GatedDeltaNetForCausalLM,
    GLAConfig,
    GLAForCausalLM,
    KDAConfig,
    KDAForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    PrecondGatedDeltaNetConfig,
    PrecondGatedDeltaNetForCausalLM,
    RetNetConfig,
    RetNetForCausalLM,
)
from fla.models.modeling_utils import FLAForCausalLM
from transformers import AutoConfig, AutoModelForCausalLM

from ccq_eval.model import fla_cpu
from ccq_eval.model.backbones.delta_net import CCQDeltaNet
from ccq_eval.model.backbones.gated_deltanet import CCQGatedDeltaNet
from ccq_eval.model.backbones.gla import CCQGatedLinearAttention
from ccq_eval.model.backbones.kda import CCQKimiDeltaAttention
from ccq_eval.model.backbones.mamba2 import CCQMamba2
from ccq_eval.model.backbones.precond_gated_deltanet import CCQPrecondGatedDeltaNet
from ccq_eval.model.backbones.retnet import CCQMultiScaleRetention
from ccq_eval.model.backbones.seam import (  # noqa: F401  (re-exported: inspection and benchmarks use them)
    _CCQ_LAYER,
    READ_KERNELS,
    CCQReadMixin,
)
from ccq_eval.model.ccq import CCQ_FORMS
from ccq_eval.model.kernels import autotune

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


class CCQDeltaNetConfig(CCQConfigMixin, DeltaNetConfig):
    model_type = "ccq_delta_net"

    def __init__(self, **kwargs):
        ccq_kwargs = _pop_ccq_kwargs(kwargs)
        super().__init__(**kwargs)
        self._init_ccq(**ccq_kwargs)


class CCQKDAConfig(CCQConfigMixin, KDAConfig):
    model_type = "ccq_kda"

    def __init__(self, **kwargs):
        ccq_kwargs = _pop_ccq_kwargs(kwargs)
        super().__init__(**kwargs)
        self._init_ccq(**ccq_kwargs)


class CCQRetNetConfig(CCQConfigMixin, RetNetConfig):
    model_type = "ccq_retnet"

    def __init__(self, **kwargs):
        ccq_kwargs = _pop_ccq_kwargs(kwargs)
        super().__init__(**kwargs)
        self._init_ccq(**ccq_kwargs)


class CCQMamba2Config(CCQConfigMixin, Mamba2Config):
    model_type = "ccq_mamba2"

    def __init__(self, **kwargs):
        ccq_kwargs = _pop_ccq_kwargs(kwargs)
        super().__init__(**kwargs)
        self._init_ccq(**ccq_kwargs)


class CCQPrecondGatedDeltaNetConfig(CCQConfigMixin, PrecondGatedDeltaNetConfig):
    model_type = "ccq_precond_gated_deltanet"

    def __init__(self, **kwargs):
        ccq_kwargs = _pop_ccq_kwargs(kwargs)
        super().__init__(**kwargs)
        self._init_ccq(**ccq_kwargs)


class CCQCausalLMMixin:
    """Turns the fla layers of a freshly built model into CCQ layers and its other fla modules into ones
    that also run on CPU (fla_cpu.use_torch_backend), and fixes generate()'s cache name."""

    _ccq_layer_types: ClassVar[dict[type, type]] = {}

    # fla's loss computation, building its fused losses as classes that also run on CPU
    _compute_logits_and_loss = fla_cpu.backend.loss_on_any_device(FLAForCausalLM._compute_logits_and_loss)

    def __init__(self, config):
        prepare_runtime()
        super().__init__(config)
        self._attach_ccq_layers(config)

    def _attach_ccq_layers(self, config) -> None:
        for module in self.modules():
            ccq_type = self._ccq_layer_types.get(type(module))
            if ccq_type is not None:
                # The fla layer keeps its submodules and parameter names; only its class changes.
                module.__class__ = ccq_type
                module.attach_ccq(config)
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


class CCQGatedDeltaNetForCausalLM(CCQCausalLMMixin, GatedDeltaNetForCausalLM):
    config_class = CCQGatedDeltaNetConfig
    _ccq_layer_types: ClassVar[dict[type, type]] = {GatedDeltaNet: CCQGatedDeltaNet}


class CCQDeltaNetForCausalLM(CCQCausalLMMixin, DeltaNetForCausalLM):
    config_class = CCQDeltaNetConfig
    _ccq_layer_types: ClassVar[dict[type, type]] = {DeltaNet: CCQDeltaNet}


class CCQKDAForCausalLM(CCQCausalLMMixin, KDAForCausalLM):
    config_class = CCQKDAConfig
    _ccq_layer_types: ClassVar[dict[type, type]] = {KimiDeltaAttention: CCQKimiDeltaAttention}


class CCQRetNetForCausalLM(CCQCausalLMMixin, RetNetForCausalLM):
    config_class = CCQRetNetConfig
    _ccq_layer_types: ClassVar[dict[type, type]] = {MultiScaleRetention: CCQMultiScaleRetention}


class CCQMamba2ForCausalLM(CCQCausalLMMixin, Mamba2ForCausalLM):
    config_class = CCQMamba2Config
    _ccq_layer_types: ClassVar[dict[type, type]] = {Mamba2: CCQMamba2}


class CCQPrecondGatedDeltaNetForCausalLM(CCQCausalLMMixin, PrecondGatedDeltaNetForCausalLM):
    config_class = CCQPrecondGatedDeltaNetConfig
    _ccq_layer_types: ClassVar[dict[type, type]] = {PrecondGatedDeltaNet: CCQPrecondGatedDeltaNet}


# plain fla model type -> (CCQ config class, CCQ causal-LM class): every backbone CCQ attaches to.
CCQ_CLASSES: dict[str, tuple[type, type]] = {
    "gla": (CCQGLAConfig, CCQGLAForCausalLM),
    "gated_deltanet": (CCQGatedDeltaNetConfig, CCQGatedDeltaNetForCausalLM),
    "delta_net": (CCQDeltaNetConfig, CCQDeltaNetForCausalLM),
    "kda": (CCQKDAConfig, CCQKDAForCausalLM),
    "retnet": (CCQRetNetConfig, CCQRetNetForCausalLM),
    "mamba2": (CCQMamba2Config, CCQMamba2ForCausalLM),
    "precond_gated_deltanet": (CCQPrecondGatedDeltaNetConfig, CCQPrecondGatedDeltaNetForCausalLM),
}


def register() -> None:
    """Make the model types known to transformers' Auto classes (idempotent)."""
    for config_cls, model_cls in CCQ_CLASSES.values():
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
