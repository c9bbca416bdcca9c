"""DeltaNet (fla.layers.delta_net.DeltaNet) as a CCQ backbone.

r is the query the delta-rule kernel reads with: with qk_norm "l2" (fla's default) the kernel normalises q
and k itself, so the read normalises them first, as the kernel would, and calls it with q~ and the unit
keys; with "sum" the layer normalises them before the call. DeltaNet does not forget (its state changes
only by the delta rule's corrections), so gamma_t = 1: Sigma_t is the plain covariance of every key so far.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from fla.layers.delta_net import DeltaNet

from ccq_eval.model.backbones.seam import Backbone, CCQReadMixin, KernelRead, same_dtype_float, serve_reads
from ccq_eval.model.kernels.l2norm_pair import l2norm_pair


def unit_query_and_keys(call: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, bool, dict[str, Any]]:
    """(r, keys, keys_unit, call) for a delta-rule kernel call: where the kernel would L2-normalise q and k
    (use_qk_l2norm_in_kernel), they are normalised here and the kernel told not to do it again."""
    if not call.get("use_qk_l2norm_in_kernel"):
        return call["q"], call["k"], False, call
    q, k = l2norm_pair(call["q"], call["k"])
    return q, k, True, {**call, "k": k, "use_qk_l2norm_in_kernel": False}


class DeltaNetBackbone(Backbone):
    model_type = "delta_net"
    layer_class = DeltaNet
    read_kernels: ClassVar[dict[str, str]] = {"chunk_delta_rule": "chunk_delta_rule",
                    "fused_recurrent_delta_rule": "fused_recurrent_delta_rule"}

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        r, keys, keys_unit, kernel_call = unit_query_and_keys(call)
        no_decay = torch.zeros(r.shape[:3], dtype=same_dtype_float(r), device=r.device)
        return KernelRead(r, keys, no_decay, keys_unit, kernel_call)


serve_reads(*DeltaNetBackbone.read_kernels.values())


class CCQDeltaNet(CCQReadMixin, DeltaNet):
    """fla's DeltaNet reading with q~ (fla's forward, CCQ in its kernel calls)."""

    ccq_backbone = DeltaNetBackbone()
    _fla_forward = ccq_backbone.bound_forward()
