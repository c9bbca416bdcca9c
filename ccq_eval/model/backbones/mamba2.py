"""Mamba2 (fla.layers.mamba2.Mamba2) as a CCQ backbone.

Mamba2's SSD recurrence h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t is a linear attention with
query C_t, key B_t, value dt_t x_t and the per-head scalar decay exp(A dt_t): r = C (the state read with it),
the keys are B (what the state is written along) and gamma_t = exp(A dt_t), the layer's own forgetting.
Heads of one group share B and C, but each head decays at its own rate, so each head keeps its own
covariance.

fla's Mamba2 forward runs mamba_ssm's fused scan, which takes C inside; the CCQ layer runs ccq-eval's torch
forward of the layer instead (ccq_eval.model.fla_cpu.mamba2, tied to fla's by the fla_cpu tests), which
computes the SSD as fla's simple-GLA op (fla's kernel on CUDA, the torch backend elsewhere): its SSD call
reads with q~. With `ccq=False` the layer runs fla's forward (the torch backend's on the CPU).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fla.layers.mamba2 import Mamba2

from ccq_eval.model.backbones.seam import Backbone, CCQReadMixin, KernelRead, ccq_kernel_read, serve_reads
from ccq_eval.model.fla_cpu import mamba2 as mamba2_cpu
from ccq_eval.model.fla_cpu.backend import rebind, torch_backend_class


class Mamba2Backbone(Backbone):
    model_type = "mamba2"
    layer_class = Mamba2
    # the names ccq-eval's Mamba2 forward calls its SSD by -> the fla op that serves them on every device
    read_kernels: ClassVar[dict[str, str]] = {"chunk_simple_gla": "chunk_simple_gla",
                    "torch_fused_recurrent_simple_gla": "fused_recurrent_simple_gla"}

    def forward_function(self):
        return mamba2_cpu._mamba2_mix

    def bound_forward(self):
        reads = {name: ccq_kernel_read(self, name) for name in self.read_kernels}
        return rebind(mamba2_cpu._mamba2_forward_cpu, _mamba2_mix=rebind(self.forward_function(), **reads))

    def baseline_forward(self):
        return torch_backend_class(Mamba2).forward

    def query_shape(self, layer) -> tuple[int, int]:
        return layer.num_heads, layer.ssm_state_size

    def read_inputs(self, name: str, call: dict[str, Any]) -> KernelRead:
        return KernelRead(call["q"], call["k"], call["g"], False, call)


serve_reads(*Mamba2Backbone.read_kernels.values())


class CCQMamba2(CCQReadMixin, Mamba2):
    """fla's Mamba2 reading with q~ (ccq-eval's forward of the layer, CCQ in its SSD call)."""

    ccq_backbone = Mamba2Backbone()
    _fla_forward = ccq_backbone.bound_forward()
