"""Torch versions of fla's ops for the retention layers (fla 0.6): RetNet (MultiScaleRetention) and HGRN2.

- Retention: linear attention with a fixed decay per head, gamma_h = 1 - 2^(-5 - h) (fla's, and the RetNet
  paper's, head decays), i.e. simple GLA with g_gamma = log(gamma); the chunked, recurrent and parallel forms
  run the simple-GLA torch ops of linear_attention.py with that g_gamma.
- rotary_embedding: the RoPE rotation fla's RotaryEmbedding applies (its cos / sin tables are torch already).
- rms_norm_linear: RMSNorm followed by a linear projection (HGRN2's output), fused in fla.

HGRN2's gated linear attention (chunk_gla / fused_recurrent_gla) and swish are served by dispatch.OPS.
fused_chunk_gla is deprecated in fla 0.6 (it raises on every device) and stays fla's.

OPS: fla op name -> FlaOp (merged into dispatch.OPS; a layer whose code looks the name up gets the
dispatcher bound in its place). MODULE_FORWARDS: "fla.module.path:Class" -> (torch forward, name of the
tensor argument that decides the device) (merged into the backend's module table).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ccq_eval.model.fla_cpu.common import FlaOp, check_varlen, compute_dtype
from ccq_eval.model.fla_cpu.linear_attention import torch_chunk_simple_gla, torch_fused_recurrent_simple_gla
from ccq_eval.model.fla_cpu.modules import torch_rms_norm

# --------------------------------------------------------------------------------------------
# retention
# --------------------------------------------------------------------------------------------


def retention_log_decay(num_heads: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """log(gamma_h) = log(1 - 2^(-5 - h)) for h = 0 .. num_heads - 1: fla's retention head decays.
    Computed in `dtype` (1 - 2^(-5 - h) is exact in binary floating point, so only the log rounds)."""
    return torch.log1p(-torch.exp2(-5.0 - torch.arange(num_heads, dtype=dtype, device=device)))


def torch_chunk_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise retention: q, k [B, T, H, K], v [B, T, H, V], state [N, H, K, V]; S_t = gamma_h S_{t-1} + k_t v_t^T,
    o_t = S_t^T (scale * q_t). Returns (o in v.dtype, final state in the compute dtype or None)."""
    g_gamma = retention_log_decay(q.shape[2], compute_dtype(q, k, v, initial_state), q.device)
    return torch_chunk_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


def torch_fused_recurrent_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token retention (decode). state_v_first: states [N, H, V, K]; `transpose_state_layout` is
    fla's deprecated name for it. Returns (o in q.dtype, final state in the compute dtype or None)."""
    if transpose_state_layout is not None:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn(
            "`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning, stacklevel=2
        )
        state_v_first = transpose_state_layout
    g_gamma = retention_log_decay(q.shape[2], compute_dtype(q, k, v, initial_state), q.device)
    return torch_fused_recurrent_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )


def torch_parallel_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    output_attentions: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Retention without states, as fla's parallel form: returns (o in q.dtype, attention scores or None).

    The output is computed chunkwise; the scores A[b, h, t, s] = scale * q_t . k_s * gamma_h^(t - s) (s <= t,
    else 0), [B, H, T, T] in q.dtype, are built only when output_attentions is set (not with cu_seqlens, as fla).
    """
    check_varlen(q, cu_seqlens, None)
    if output_attentions and cu_seqlens is not None:
        raise ValueError("parallel_retention: output_attentions=True is not supported with variable-length sequences.")
    o, _ = torch_chunk_retention(q, k, v, scale=scale, cu_seqlens=cu_seqlens)
    attn = None
    if output_attentions:
        dtype = compute_dtype(q, k, v)
        T, H = q.shape[1], q.shape[2]
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        steps = torch.arange(T, device=q.device)
        distance = (steps[:, None] - steps[None, :]).to(dtype)  # t - s
        log_decay = retention_log_decay(H, dtype, q.device)[:, None, None] * distance  # [H, T, T]
        log_decay = log_decay.masked_fill(distance < 0, float("-inf"))
        scores = torch.einsum("bthk,bshk->bhts", q.to(dtype) * scale, k.to(dtype))
        attn = (scores * log_decay.exp()).to(q.dtype)
    return o.to(q.dtype), attn


# --------------------------------------------------------------------------------------------
# rotary embedding, rms_norm_linear
# --------------------------------------------------------------------------------------------


def _rotary_positions(
    x: torch.Tensor, seqlen_offsets: int | torch.Tensor, cu_seqlens: torch.LongTensor | None
) -> torch.Tensor:
    """The position of every token of x [B, T, ...] in the cos / sin tables: [B, T], or [1, total] when packed."""
    B, T = x.shape[:2]
    steps = torch.arange(T, device=x.device)
    if cu_seqlens is None:
        offsets = seqlen_offsets[:, None] if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
        return (steps[None, :] + offsets).expand(B, T)
    starts = cu_seqlens[:-1].to(x.device)
    sequence = torch.bucketize(steps, cu_seqlens[1:].to(x.device), right=True)  # which packed sequence
    positions = steps - starts[sequence]
    if isinstance(seqlen_offsets, torch.Tensor):
        positions = positions + seqlen_offsets.to(x.device)[sequence]
    else:
        positions = positions + seqlen_offsets
    return positions[None, :]


def torch_rotary_embedding(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.LongTensor | None = None,
) -> torch.Tensor:
    """RoPE on the first 2R channels of each head of x [B, T, H, D]; cos, sin [TR, R] indexed by position
    t + seqlen_offsets (an int, or one offset per sequence [N]). Channel pairs are (i, i + R), or (2i, 2i + 1)
    if interleaved: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos). Positions outside [0, TR) are left zero in
    the rotated channels (unchanged if inplace), as fla's kernel does under left padding. Returns x.dtype;
    inplace writes the result into x and returns x."""
    B, T, _, D = x.shape
    TR, R = cos.shape
    if 2 * R > D:
        raise ValueError(f"rotary_embedding: rotary dimension {2 * R} exceeds the head dimension {D}.")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"rotary_embedding: cu_seqlens needs the batch size to be 1, got {B}.")
    if not isinstance(seqlen_offsets, torch.Tensor) and (cu_seqlens is None and seqlen_offsets + T > TR):
        raise ValueError(f"rotary_embedding: the cos / sin tables have {TR} positions, {seqlen_offsets + T} needed.")
    dtype = compute_dtype(x, cos, sin)
    positions = _rotary_positions(x, seqlen_offsets, cu_seqlens)
    valid = ((positions >= 0) & (positions < TR))[..., None, None]  # [B, T, 1, 1]
    index = positions.clamp(0, TR - 1)
    c, s = cos.to(dtype)[index][:, :, None], sin.to(dtype)[index][:, :, None]  # [B, T, 1, R]
    rotated = x[..., : 2 * R].to(dtype)
    if interleaved:
        x0, x1 = rotated[..., 0::2], rotated[..., 1::2]
        y = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    else:
        x0, x1 = rotated[..., :R], rotated[..., R:]
        y = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    y = torch.where(valid, y, rotated if inplace else 0.0).to(x.dtype)
    if 2 * R < D:
        y = torch.cat([y, x[..., 2 * R :]], dim=-1)
    if inplace:
        return x.copy_(y)
    return y


def torch_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """F.linear(rmsnorm(x + residual), linear_weight, linear_bias): the norm in the compute dtype, rounded to
    x.dtype, the projection in linear_weight's dtype (as fla). prenorm=True also returns x + residual."""
    normed = torch_rms_norm(x, norm_weight, norm_bias, residual, eps, prenorm, residual_in_fp32)
    y, summed = normed if prenorm else (normed, None)
    out = F.linear(y.to(linear_weight.dtype), linear_weight, linear_bias)
    return (out, summed) if prenorm else out


OPS: dict[str, FlaOp] = {
    "chunk_retention": FlaOp("fla.ops.retention.chunk", torch_chunk_retention),
    # fla's fused-chunk form computes the same thing with the same parameters
    "fused_chunk_retention": FlaOp("fla.ops.retention.fused_chunk", torch_chunk_retention),
    "fused_recurrent_retention": FlaOp(
        "fla.ops.retention.fused_recurrent", torch_fused_recurrent_retention, from_kwargs=("transpose_state_layout",)),
    "parallel_retention": FlaOp("fla.ops.retention.parallel", torch_parallel_retention),
    "rotary_embedding": FlaOp("fla.modules.rotary.ops", torch_rotary_embedding),
    "rms_norm_linear": FlaOp("fla.modules.layernorm", torch_rms_norm_linear),
}
MODULE_FORWARDS: dict[str, tuple[Callable, str]] = {}
