"""Gated DeltaNet (fla.layers.gated_deltanet.GatedDeltaNet) as a CCQ backbone.

fla's layer hands its kernel the raw q and k with use_qk_l2norm_in_kernel and the raw gate with
use_gate_in_kernel; the read normalises q and k and forms the decay g = -exp(A_log) softplus(a + dt_bias)
outside the kernel, as the kernel would, so that r is the unit query the read uses, the keys are the unit
keys written, and gamma_t = exp(g_t), the layer's own scalar forgetting. The kernel then reads q~ without
normalising it again.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn.functional as F
from fla.layers.gated_deltanet import GatedDeltaNet

from ccq_eval.model.backbones.seam import Backbone, CCQReadMixin, KernelRead, serve_reads
from ccq_eval.model.kernels.l2norm_pair import l2norm_pair


def check_same_heads(layer, family: str) -> None:
    if layer.num_v_heads != layer.num_heads:
        raise ValueError(
            f"CCQ needs num_v_heads == num_heads (got {layer.num_v_heads} and {layer.num_heads}): grouped value "
            f"heads have several decays per key head. Set ccq=false for this {family} model."
        )


class GatedDeltaNetBackbone(Backbone):
    model_type = "gated_deltanet"
    layer_class = GatedDeltaNet
    read_kernels: ClassVar[dict[str, str]] = {"chunk_gated_delta_rule": "chunk_gated_delta_rule",
                    "fused_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}

    def check_layer(self, layer) -> None:
        check_same_heads(layer, "Gated DeltaNet")

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        if not (call.get("use_qk_l2norm_in_kernel") and call.get("use_gate_in_kernel")):
            raise RuntimeError(
                f"CCQ: fla's GatedDeltaNet calls {name} without use_qk_l2norm_in_kernel / use_gate_in_kernel; "
                "the installed fla differs from the one ccq-eval was written against (pyproject.toml pins it).")
        # q and k normalised together, read from their strided views (one Triton launch on CUDA, no
        # torch.stack copy: ccq_eval/model/kernels/l2norm_pair.py); each comes out contiguous.
        q, k = l2norm_pair(call["q"], call["k"])
        log_decay = -call["A_log"].float().exp() * F.softplus(call["g"].float() + call["dt_bias"].float())
        return KernelRead(q, k, log_decay, True, {**call, "k": k, "use_qk_l2norm_in_kernel": False})


serve_reads(*GatedDeltaNetBackbone.read_kernels.values())


class CCQGatedDeltaNet(CCQReadMixin, GatedDeltaNet):
    """fla's GatedDeltaNet reading with q~ (fla's forward, CCQ in its kernel calls)."""

    ccq_backbone = GatedDeltaNetBackbone()
    _fla_forward = ccq_backbone.bound_forward()
