"""KDA (fla.layers.kda.KimiDeltaAttention) as a CCQ backbone.

As Gated DeltaNet, the kernel normalises q and k and forms the decay from the raw gate itself; the read
normalises q and k first (r: the unit query the kernel reads with; keys: the unit keys) and passes the raw
gate on unchanged, so the kernel computes the same decay as without CCQ. KDA decays every key channel at
its own rate; gamma_t = exp(mean_j g_t[j]), the geometric mean of the per-channel decays (the layer's gate
as the kernel forms it: fla's fused_kda_gate), a scalar, so that Sigma_t stays symmetric.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fla.layers.kda import KimiDeltaAttention

from ccq_eval.model.backbones.delta_net import unit_query_and_keys
from ccq_eval.model.backbones.gated_deltanet import check_same_heads
from ccq_eval.model.backbones.seam import Backbone, CCQReadMixin, KernelRead, same_dtype_float, serve_reads
from ccq_eval.model.fla_cpu import dispatch


class KDABackbone(Backbone):
    model_type = "kda"
    layer_class = KimiDeltaAttention
    read_kernels: ClassVar[dict[str, str]] = {"chunk_kda": "chunk_kda", "fused_recurrent_kda": "fused_recurrent_kda"}

    def check_layer(self, layer) -> None:
        check_same_heads(layer, "KDA")

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        r, keys, keys_unit, kernel_call = unit_query_and_keys(call)
        dtype = same_dtype_float(r)
        log_decay = call["g"]
        if call.get("use_gate_in_kernel"):
            log_decay = dispatch.dispatcher("fused_kda_gate")(
                call["g"], call.get("A_log"), call.get("dt_bias"), call.get("lower_bound"), output_dtype=dtype)
        return KernelRead(r, keys, log_decay.mean(-1, dtype=dtype), keys_unit, kernel_call)


serve_reads(*KDABackbone.read_kernels.values())


class CCQKimiDeltaAttention(CCQReadMixin, KimiDeltaAttention):
    """fla's KimiDeltaAttention reading with q~ (fla's forward, CCQ in its kernel calls)."""

    ccq_backbone = KDABackbone()
    _fla_forward = ccq_backbone.bound_forward()
