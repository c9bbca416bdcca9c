"""A torch backend for flash-linear-attention's triton-only ops, so that fla's models run on CPU (fla 0.6):
GLA and Gated DeltaNet, and DeltaNet, KDA, Preconditioned Gated DeltaNet / KDA, Mamba2, RetNet, HGRN2 and
RWKV7 (ccq_eval.model.families.CPU_LAYERS). CUDA tensors keep fla's kernels.

- `linear_attention`, `delta_rule`, `modules`, `dqkwg`: the torch implementations for GLA and Gated
  DeltaNet, one op family each (`torch_*`, device-agnostic, also used by the GPU tests as references);
- `delta_variants` (with `delta_general`), `mamba2`, `retention`, `rwkv7`: the other families, each with
  its own OPS and MODULE_FORWARDS tables;
- `dispatch`: one table (`OPS`, the family tables merged in) and the dispatchers with fla's names and
  signatures.
- `backend`: `use_torch_backend(model)` makes one model's fla modules call the dispatchers (subclasses
  of fla's classes, fla's forward code with our op names); fla itself is never patched, so any other
  fla model in the process behaves as without ccq-eval.

Numerics: every op computes in float32 or wider (float64 inputs stay float64) and casts its output
to the dtype fla's kernel would return; recurrent states come back in the compute dtype. The
chunked forms are chunkwise (chunk size 64, padded tails) and never build a T x T matrix; long
sequences run in segments of SEGMENT_TOKENS, each checkpointed under autograd.

Algorithms follow the papers of each family (GLA and Gated DeltaNet: Yang et al. 2023 / 2024); the code is
ours, tied to fla's naive references by the tests.
"""

from ccq_eval.model.fla_cpu.backend import rebind, torch_backend_class, use_torch_backend
from ccq_eval.model.fla_cpu.common import CHUNK_SIZE, SEGMENT_TOKENS
from ccq_eval.model.fla_cpu.delta_rule import (
    torch_chunk_gated_delta_rule,
    torch_fused_recurrent_gated_delta_rule,
    torch_l2norm,
)
from ccq_eval.model.fla_cpu.dispatch import (
    OPS,
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    chunk_gla,
    chunk_simple_gla,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gla,
    fused_recurrent_simple_gla,
    l2norm,
    logsigmoid,
    rms_norm,
    rms_norm_gated,
    sigmoid,
    swiglu,
    swiglu_linear,
    swish,
)
from ccq_eval.model.fla_cpu.dqkwg import hopper_safe_op, torch_chunk_bwd_dqkwg
from ccq_eval.model.fla_cpu.linear_attention import (
    torch_chunk_gla,
    torch_chunk_simple_gla,
    torch_fused_recurrent_gla,
    torch_fused_recurrent_simple_gla,
)
from ccq_eval.model.fla_cpu.modules import (
    torch_causal_conv1d,
    torch_causal_conv1d_update,
    torch_cross_entropy,
    torch_logsigmoid,
    torch_rms_norm,
    torch_rms_norm_gated,
    torch_sigmoid,
    torch_swiglu,
    torch_swiglu_linear,
    torch_swish,
)

__all__ = [
    "CHUNK_SIZE",
    "OPS",
    "SEGMENT_TOKENS",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_simple_gla",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_simple_gla",
    "hopper_safe_op",
    "l2norm",
    "logsigmoid",
    "rebind",
    "rms_norm",
    "rms_norm_gated",
    "sigmoid",
    "swiglu",
    "swiglu_linear",
    "swish",
    "torch_backend_class",
    "torch_causal_conv1d",
    "torch_causal_conv1d_update",
    "torch_chunk_bwd_dqkwg",
    "torch_chunk_gated_delta_rule",
    "torch_chunk_gla",
    "torch_chunk_simple_gla",
    "torch_cross_entropy",
    "torch_fused_recurrent_gated_delta_rule",
    "torch_fused_recurrent_gla",
    "torch_fused_recurrent_simple_gla",
    "torch_l2norm",
    "torch_logsigmoid",
    "torch_rms_norm",
    "torch_rms_norm_gated",
    "torch_sigmoid",
    "torch_swiglu",
    "torch_swiglu_linear",
    "torch_swish",
    "use_torch_backend",
]
