"""RetNet (fla.layers.multiscale_retention.MultiScaleRetention) as a CCQ backbone: the scalar-decay case.

r and the keys are the query and keys the retention kernel reads and writes (after projection, optional
short convolution, feature map and rotary embedding). Retention forgets at a fixed rate per head,
gamma_h = 1 - 2^(-5 - h) (fla's head decays), a scalar already, so CCQ's gamma_t is exactly the layer's.
fla's parallel form keeps no state, so it cannot carry CCQ's: a CCQ layer refuses it (attn_mode "chunk",
"fused_chunk" or "fused_recurrent" read with q~).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fla.layers.multiscale_retention import MultiScaleRetention

from ccq_eval.model.backbones.seam import Backbone, CCQReadMixin, KernelRead, same_dtype_float, serve_reads
from ccq_eval.model.fla_cpu.retention import retention_log_decay


class RetNetBackbone(Backbone):
    model_type = "retnet"
    layer_class = MultiScaleRetention
    read_kernels: ClassVar[dict[str, str]] = {
        "chunk_retention": "chunk_retention", "fused_chunk_retention": "fused_chunk_retention",
        "fused_recurrent_retention": "fused_recurrent_retention"}
    refused_kernels = ("parallel_retention",)

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        q = call["q"]
        B, T, H, _ = q.shape
        log_decay = retention_log_decay(H, same_dtype_float(q), q.device).expand(B, T, H)
        return KernelRead(q, call["k"], log_decay, False, call)


serve_reads(*RetNetBackbone.read_kernels.values())


class CCQMultiScaleRetention(CCQReadMixin, MultiScaleRetention):
    """fla's MultiScaleRetention reading with q~ (fla's forward, CCQ in its kernel calls)."""

    ccq_backbone = RetNetBackbone()
    _fla_forward = ccq_backbone.bound_forward()
