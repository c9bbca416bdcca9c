"""Preconditioned Gated DeltaNet (fla.layers.precond_gated_deltanet.PrecondGatedDeltaNet) as a CCQ backbone.

The layer is Gated DeltaNet with a write-side preconditioner: the kernel L2-normalises q and k, keeps the ATK
statistic A_t = exp(g_atk_t) A_{t-1} + beta_atk_t k_t^2 (a decayed second moment of the unit keys per key
channel, carried between calls as `initial_A_state`), and writes the state along w_t = M_t * k_t, where
M_t = squash(A_t) in [1/x, x] per channel damps the channels the keys have crowded. The correction reads
the state along k_t, the output along q_t.

r is the unit query the kernel reads with (normalised here, as the kernel would, and the kernel told not to
normalise again); the keys are the written keys w_t, formed from the call's own statistic inputs
(fla_cpu.delta_general.preconditioned_keys, tied to fla's naive reference by the fla_cpu tests), since
Sigma is to estimate where the state's stored keys lie; gamma_t = exp(g_t), the main recurrence's scalar
forgetting (g_atk is the statistic's own). The A state stays where the layer keeps it: the kernel takes it
as `initial_A_state` and returns it third, beside the (S, P, m, n) state, so the layer caches
((S, P, m, n), A). fla's `naive` mode normalises q itself, with no flag to turn that off, so it would
read with q~ / ||q~||, not q~: a CCQ layer refuses it (use `chunk` or `fused_recurrent`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fla.layers.precond_gated_deltanet import PrecondGatedDeltaNet

from ccq_eval.model.backbones.gated_deltanet import check_same_heads
from ccq_eval.model.backbones.seam import Backbone, CCQReadMixin, KernelRead, same_dtype_float, serve_reads
from ccq_eval.model.fla_cpu.delta_general import preconditioned_keys
from ccq_eval.model.kernels.l2norm_pair import l2norm_pair


class PrecondGatedDeltaNetBackbone(Backbone):
    model_type = "precond_gated_deltanet"
    layer_class = PrecondGatedDeltaNet
    read_kernels: ClassVar[dict[str, str]] = {
        "chunk_precond_gated_delta_rule": "chunk_precond_gated_delta_rule",
        "fused_recurrent_precond_gated_delta_rule": "fused_recurrent_precond_gated_delta_rule"}
    refused_kernels = ("naive_recurrent_precond_gated_delta_rule",)

    def check_layer(self, layer) -> None:
        check_same_heads(layer, "Preconditioned Gated DeltaNet")

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        if not call.get("use_qk_l2norm_in_kernel") or call.get("gk") is not None or call.get("gv") is not None:
            raise RuntimeError(
                f"CCQ: fla's PrecondGatedDeltaNet calls {name} without use_qk_l2norm_in_kernel or with a per-channel "
                "decay; the installed fla differs from the one ccq-eval was written against (pyproject.toml pins it).")
        q, k = l2norm_pair(call["q"], call["k"])
        dtype = same_dtype_float(q)
        written, _ = preconditioned_keys(k.to(dtype), call["g_atk"], call["beta_atk"], call["initial_A_state"],
                                         call["x"], call["eps"], call["log_atk_scale"], dtype)
        return KernelRead(q, written, call["g"].to(dtype), False, {**call, "k": k, "use_qk_l2norm_in_kernel": False})


serve_reads(*PrecondGatedDeltaNetBackbone.read_kernels.values())


class CCQPrecondGatedDeltaNet(CCQReadMixin, PrecondGatedDeltaNet):
    """fla's PrecondGatedDeltaNet reading with q~ (fla's forward, CCQ in its kernel calls)."""

    ccq_backbone = PrecondGatedDeltaNetBackbone()
    _fla_forward = ccq_backbone.bound_forward()
