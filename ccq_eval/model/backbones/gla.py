"""GLA (fla.layers.gla.GatedLinearAttention) as a CCQ backbone.

r is the query the GLA kernel gets (after projection, optional short convolution and feature map), the keys
are the layer's keys, and gamma_t = exp(mean_j gk_t[j]): the geometric mean of GLA's per-channel decays,
a scalar, so that Sigma_t stays symmetric.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from fla.layers.gla import GatedLinearAttention

from ccq_eval.model.backbones.seam import Backbone, CCQReadMixin, KernelRead, serve_reads


class GLABackbone(Backbone):
    model_type = "gla"
    layer_class = GatedLinearAttention
    read_kernels: ClassVar[dict[str, str]] = {"chunk_gla": "chunk_gla", "fused_recurrent_gla": "fused_recurrent_gla"}

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        log_gate = call["g"] if "g" in call else call["gk"]  # chunk_gla: g, fused_recurrent_gla: gk
        return KernelRead(call["q"], call["k"], log_gate.mean(-1, dtype=torch.float32), False, call)


serve_reads(*GLABackbone.read_kernels.values())


class CCQGatedLinearAttention(CCQReadMixin, GatedLinearAttention):
    """fla's GatedLinearAttention, reading its state with q~ (fla's forward, CCQ in its kernel calls)."""

    ccq_backbone = GLABackbone()
    _fla_forward = ccq_backbone.bound_forward()
