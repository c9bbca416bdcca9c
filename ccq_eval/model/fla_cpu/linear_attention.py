"""CPU backend for flash-linear-attention (fla 0.6.0).

fla's GLA and Gated DeltaNet models are built from triton kernels only; on a machine without a
GPU every one of them fails. This module provides pure-torch implementations of each piece those
two model families use, plus dispatching wrappers with fla's signatures: a call whose tensors live
on CUDA goes to the original fla function (triton, unchanged), anything else to the torch code.

Public API
- Ops with fla's signatures and return conventions (dispatching on the device of the first tensor):
  chunk_gla, fused_recurrent_gla, chunk_simple_gla, fused_recurrent_simple_gla,
  chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, l2norm, causal_conv1d,
  causal_conv1d_update, swiglu, swiglu_linear, rms_norm, rms_norm_gated.
- The torch implementations themselves (device-agnostic, used on CPU and by the GPU tests):
  the same names prefixed with `torch_`, plus torch_cross_entropy.
- install(): patch fla's layer modules, module classes, activation table and losses (idempotent).

Numerics: every op computes in float32 or wider (float64 inputs stay float64), then casts its
output to the dtype fla's kernel would return. Recurrent states come back in the compute dtype
(float32 for bf16/fp16/fp32 inputs, as fla's kernels do; float64 for float64 inputs).

The chunked forms are genuinely chunkwise (chunk size 64, padded tails) and never build a T x T
matrix: memory is O(T * C) plus one state per chunk, like fla's kernels. Sequences are processed
in segments of SEGMENT_TOKENS; with autograd each segment is checkpointed, so what stays alive
for backward is the segment inputs and outputs, not the per-chunk intermediates.

Algorithms (facts from the GLA and Gated DeltaNet papers, Yang et al. 2023 / 2024; code is ours):
- Linear attention with per-step log decay g_t: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,
  o_t = S_t^T (scale * q_t). Chunkwise: intra-chunk attention with relative decays + a scan over
  chunk states.
- Gated delta rule: S_t = exp(g_t) S_{t-1}; S_t += beta_t k_t (v_t - S_t^T k_t)^T; o_t = S_t^T q_t.
  Chunkwise via the UT / WY transform: within a chunk the corrections solve a unit lower
  triangular system (I + N) X = [beta v, beta gamma k].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_SIZE = 64
# Sub-block size used inside a GLA chunk: the per-channel decay between two positions of the same
# sub-block is evaluated exactly (elementwise), sub-blocks further apart factorise through the
# sub-block boundary with exponents <= 0, so nothing can overflow however strong the decay is.
GLA_SUB_BLOCK = 16
# Tokens processed together: bounds transient memory (the GLA sub-block tensor is S*K per token).
SEGMENT_TOKENS = 2048


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32 for half / bf16 / fp32 inputs, float64 if any input is float64."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None and tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _chunk_size_for(seq_len: int) -> int:
    # fla's rule for chunk_gla: short inputs use a smaller power-of-two chunk (>= 16).
    return min(CHUNK_SIZE, max(16, 1 << max(0, seq_len - 1).bit_length()))


def _pad_time(x: torch.Tensor | None, pad: int, dim: int = 2) -> torch.Tensor | None:
    """Zero-pad the time axis `dim` at the end. Zero keys / betas / log decays add nothing."""
    if x is None or pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _heads_first(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, T, H, ...] -> [B, H, T, ...] in the compute dtype."""
    if x is None:
        return None
    return x.transpose(1, 2).to(dtype)


def _to_k_first(state: torch.Tensor | None, state_v_first: bool, dtype: torch.dtype) -> torch.Tensor | None:
    if state is None:
        return None
    state = state.to(dtype)
    return state.transpose(-1, -2) if state_v_first else state


def _from_k_first(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def _check_varlen(
    q: torch.Tensor, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None
) -> None:
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens needs the batch size to be 1 (sequences packed along time), got {q.shape[0]}. "
            "Flatten the variable-length inputs to [1, total_tokens, ...] first."
        )
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            f"initial_state has {initial_state.shape[0]} states but cu_seqlens describes "
            f"{len(cu_seqlens) - 1} sequences; pass one state per sequence."
        )


def _run_varlen(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    cu_seqlens: torch.Tensor,
    per_token: dict[str, torch.Tensor | None],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `fn` on each packed sequence of a [1, total, ...] batch separately and re-pack.

    Every per-token tensor is sliced on the time axis (dim 1); sequence i starts from
    initial_state[i]. Correct and simple; the cost is one Python call per sequence.
    """
    bounds = [int(b) for b in cu_seqlens.tolist()]
    outputs, finals = [], []
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        sliced = {name: (t[:, start:end] if t is not None else None) for name, t in per_token.items()}
        h0 = initial_state[i : i + 1] if initial_state is not None else None
        o, ht = fn(
            **sliced, initial_state=h0, output_final_state=output_final_state, cu_seqlens=None, **kwargs
        )
        outputs.append(o)
        finals.append(ht)
    o = torch.cat(outputs, dim=1)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)


def _segments(num_chunks: int, chunk: int) -> list[tuple[int, int]]:
    """Chunk-index ranges [a, b) of at most SEGMENT_TOKENS tokens each."""
    per_segment = max(1, SEGMENT_TOKENS // chunk)
    return [(a, min(a + per_segment, num_chunks)) for a in range(0, num_chunks, per_segment)]


def _scan_chunk_states(
    state: torch.Tensor,
    chunk_decay: torch.Tensor,
    chunk_update: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_{n+1} = chunk_decay_n * S_n + chunk_update_n over the chunk axis (2).

    state [B, H, K, V]; chunk_decay broadcastable to [B, H, N, K, V]; chunk_update [B, H, N, K, V].
    Returns the state at the start of every chunk [B, H, N, K, V] and the final state.
    """
    starts = []
    for n in range(chunk_update.shape[2]):
        starts.append(state)
        state = chunk_decay[:, :, n] * state + chunk_update[:, :, n]
    return torch.stack(starts, dim=2), state


def _causal_mask(size: int, device: torch.device, strict: bool = False) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _relative_decay(cum: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """exp(cum_t - cum_s) for s <= t (s < t if strict), else 0; cum [..., C] -> [..., C, C].

    The exponent is masked to -inf *before* exp so that masked entries can never overflow.
    """
    diff = cum[..., :, None] - cum[..., None, :]
    mask = _causal_mask(cum.shape[-1], cum.device, strict)
    return diff.masked_fill(~mask, float("-inf")).exp()


def _maybe_checkpoint(fn: Callable, *args: torch.Tensor | None):
    if _needs_grad(*args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


# --------------------------------------------------------------------------------------------
# linear attention with per-channel decay (GLA) and scalar decay (simple GLA)
# --------------------------------------------------------------------------------------------


def _gla_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor):
    """One segment of chunkwise GLA. q (pre-scaled), k, g: [B, H, N, C, K]; v [B, H, N, C, V];
    state [B, H, K, V] (K-first). Returns o [B, H, N, C, V] and the state after the segment."""
    C = q.shape[-2]
    sub = min(GLA_SUB_BLOCK, C)
    cum = g.cumsum(-2)  # log decay from chunk start to t, inclusive

    # Intra-chunk scores A[t, s] = sum_k q_t k_s exp(cum_t - cum_s), s <= t.
    scores = q.new_zeros(*q.shape[:-1], C)
    for start in range(0, C, sub):
        rows = slice(start, start + sub)
        # same sub-block: exact elementwise relative decay [.., S, S, K]
        cum_b = cum[..., rows, :]
        diff = cum_b[..., :, None, :] - cum_b[..., None, :, :]
        mask = _causal_mask(cum_b.shape[-2], q.device)[..., None]
        decay = diff.masked_fill(~mask, float("-inf")).exp()
        scores[..., rows, rows] = (q[..., rows, None, :] * k[..., None, rows, :] * decay).sum(-1)
        if start > 0:
            # earlier sub-blocks: factor through the boundary position start-1, both factors <= 1
            ref = cum[..., start - 1 : start, :]
            q_ref = q[..., rows, :] * (cum[..., rows, :] - ref).exp()
            k_ref = k[..., :start, :] * (ref - cum[..., :start, :]).exp()
            scores[..., rows, :start] = q_ref @ k_ref.transpose(-1, -2)
    o = scores @ v

    # Inter-chunk: state at chunk start, decayed to each position; chunk contributions to the state.
    last = cum[..., -1:, :]  # [.., N, 1, K]
    chunk_update = (k * (last - cum).exp()).transpose(-1, -2) @ v
    chunk_decay = last.transpose(-1, -2).exp()  # [.., N, K, 1]
    starts, state = _scan_chunk_states(state, chunk_decay, chunk_update)
    o = o + (q * cum.exp()) @ starts
    return o, state


def _scalar_decay_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor
):
    """One segment of chunkwise linear attention with a scalar (per head) log decay.
    q (pre-scaled), k: [B, H, N, C, K]; v [B, H, N, C, V]; g [B, H, N, C]; state [B, H, K, V]."""
    cum = g.cumsum(-1)
    o = ((q @ k.transpose(-1, -2)) * _relative_decay(cum)) @ v
    last = cum[..., -1:]
    chunk_update = (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ v
    chunk_decay = last.exp()[..., None]  # [.., N, 1, 1]
    starts, state = _scan_chunk_states(state, chunk_decay, chunk_update)
    o = o + (q * cum.exp()[..., None]) @ starts
    return o, state


def _chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
    per_channel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-first inputs [B, H, T, *] in the compute dtype (q pre-scaled); g [B, H, T, K] if
    per_channel else [B, H, T]. Returns o [B, H, T, V] and the final K-first state."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, H, 0, V), state
    C = _chunk_size_for(T)
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    q, k, v, g = (_pad_time(x, pad) for x in (q, k, v, g))
    q, k, v = (x.reshape(B, H, num_chunks, C, x.shape[-1]) for x in (q, k, v))
    g = g.reshape(B, H, num_chunks, C, K) if per_channel else g.reshape(B, H, num_chunks, C)
    segment_fn = _gla_segment if per_channel else _scalar_decay_segment
    outputs = []
    for a, b in _segments(num_chunks, C):
        o_seg, state = _maybe_checkpoint(
            segment_fn, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], g[:, :, a:b], state
        )
        outputs.append(o_seg)
    o = torch.cat(outputs, dim=2).reshape(B, H, num_chunks * C, V)[:, :, :T]
    return o, state


def _chunk_op(q, k, v, g, scale, initial_state, output_final_state, state_v_first, dtype, per_channel):
    """What chunk_gla and chunk_simple_gla share: [B, T, H, *] layout in and out, the initial and
    final state in fla's layout, o in v.dtype."""
    B, _, H, K = q.shape
    state = _to_k_first(initial_state, state_v_first, dtype)
    if state is None:
        state = q.new_zeros(B, H, K, v.shape[-1], dtype=dtype)
    o, state = _chunked_linear_attention(
        _heads_first(q, dtype) * scale, _heads_first(k, dtype), _heads_first(v, dtype), _heads_first(g, dtype),
        state, per_channel=per_channel,
    )
    return o.transpose(1, 2).to(v.dtype), (_from_k_first(state, state_v_first) if output_final_state else None)


def torch_chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise GLA: q, k, g [B, T, H, K] (g = per-step log decay <= 0), v [B, T, H, V].
    initial_state [N, H, K, V] ([N, H, V, K] if state_v_first). Returns (o in v.dtype, final state)."""
    if q.shape != k.shape or q.shape != g.shape:
        raise ValueError(f"chunk_gla: q, k, g must have the same shape, got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"chunk_gla: v must be [B, T, H, V] matching q's {tuple(q.shape[:3])}, got {tuple(v.shape)}"
        )
    _check_varlen(q, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return _run_varlen(
            torch_chunk_gla,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "g": g},
            initial_state,
            output_final_state,
            scale=scale,
            state_v_first=state_v_first,
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, initial_state)
    return _chunk_op(q, k, v, g, scale, initial_state, output_final_state, state_v_first, dtype, per_channel=True)


def torch_chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise linear attention with a scalar log decay per head and step: g [B, T, H], or a
    constant g_gamma [H], or neither (no decay). Returns (o in v.dtype, final state)."""
    if g is not None and g_gamma is not None:
        raise ValueError("chunk_simple_gla: pass either g [B, T, H] or g_gamma [H], not both.")
    _check_varlen(q, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return _run_varlen(
            torch_chunk_simple_gla,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "g": g},
            initial_state,
            output_final_state,
            g_gamma=g_gamma,
            scale=scale,
            state_v_first=state_v_first,
        )
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, g_gamma, initial_state)
    B, T, H, K = q.shape
    if g is None:
        g = q.new_zeros(B, T, H, dtype=dtype) if g_gamma is None else g_gamma.to(dtype).expand(B, T, H)
    return _chunk_op(q, k, v, g, scale, initial_state, output_final_state, state_v_first, dtype, per_channel=False)


def torch_fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    g: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GLA: S_t = exp(g_t) exp(gk_t) S_{t-1} exp(gv_t) + k_t v_t^T, o_t = S_t^T q_t.
    g [B, T, H] (scalar), gk [B, T, H, K], gv [B, T, H, V] are optional log decays.
    Returns (o in q.dtype, final state)."""
    _check_varlen(q, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return _run_varlen(
            torch_fused_recurrent_gla,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "gk": gk, "gv": gv, "g": g},
            initial_state,
            output_final_state,
            scale=scale,
            reverse=reverse,
            state_v_first=state_v_first,
        )
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, gk, gv, g, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    state = _to_k_first(initial_state, state_v_first, dtype)
    if state is None:
        state = q.new_zeros(B, H, K, V, dtype=dtype)
    qs, ks, vs = (x.to(dtype) for x in (q, k, v))
    steps = range(T - 1, -1, -1) if reverse else range(T)
    outputs: list[torch.Tensor | None] = [None] * T
    for t in steps:
        if g is not None:
            state = state * g[:, t].to(dtype).exp()[..., None, None]
        if gk is not None:
            state = state * gk[:, t].to(dtype).exp()[..., :, None]
        if gv is not None:
            state = state * gv[:, t].to(dtype).exp()[..., None, :]
        state = state + ks[:, t, :, :, None] * vs[:, t, :, None, :]
        outputs[t] = torch.einsum("bhk,bhkv->bhv", qs[:, t] * scale, state)
    o = torch.stack(outputs, dim=1) if T > 0 else v.new_zeros(B, 0, H, V, dtype=dtype)
    return o.to(q.dtype), (_from_k_first(state, state_v_first) if output_final_state else None)


def torch_fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token form of chunk_simple_gla (scalar decay g [B, T, H] or g_gamma [H])."""
    if g is not None and g_gamma is not None:
        raise ValueError("fused_recurrent_simple_gla: pass either g [B, T, H] or g_gamma [H], not both.")
    if g is None and g_gamma is not None:
        g = g_gamma.expand(q.shape[0], q.shape[1], q.shape[2])
    return torch_fused_recurrent_gla(
        q,
        k,
        v,
        g=g,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        reverse=reverse,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
    )


# --------------------------------------------------------------------------------------------
# gated delta rule
# --------------------------------------------------------------------------------------------


def torch_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis (fla's l2norm; eps inside the root)."""
    xf = x.to(_compute_dtype(x))
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y.to(x.dtype if output_dtype is None else output_dtype)


def _gdn_inputs(
    q,
    k,
    v,
    g,
    beta,
    scale,
    use_qk_l2norm_in_kernel,
    use_beta_sigmoid_in_kernel,
    allow_neg_eigval,
    use_gate_in_kernel,
    A_log,
    dt_bias,
    dtype,
):
    """Apply the in-kernel preprocessing fla's gated delta rule kernels fuse, in `dtype`, and
    repeat q / k over value heads (GVA: value head hv reads query/key head hv // (HV // H))."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"gated delta rule: q and k need the same number of heads, got {q.shape[2]} and {k.shape[2]}"
        )
    H, HV = q.shape[2], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"gated delta rule: num_v_heads ({HV}) must be a multiple of num_heads ({H})")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (fla's convention).")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = torch_l2norm(q), torch_l2norm(k)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if beta is None:
        beta = v.new_ones(v.shape[:3], dtype=dtype)
    beta = beta.to(dtype)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if g is not None:
        g = g.to(dtype)
        if use_gate_in_kernel:
            if A_log is None:
                raise ValueError("use_gate_in_kernel=True needs A_log (the per-head decay parameter).")
            if dt_bias is not None:
                g = g + dt_bias.to(dtype)
            g = -A_log.to(dtype).exp() * F.softplus(g)
    elif use_gate_in_kernel:
        raise ValueError("use_gate_in_kernel=True needs g (the raw gate pre-activation).")
    return q * scale, k, v.to(dtype), g, beta


def _gdn_segment(q, k, v, g, beta, state):
    """One segment of the chunkwise gated delta rule. q (normalised, scaled), k: [B, HV, N, C, K];
    v [B, HV, N, C, V]; g, beta [B, HV, N, C]; state [B, HV, K, V] (K-first)."""
    cum = g.cumsum(-1)
    decay = _relative_decay(cum)  # exp(cum_t - cum_s), s <= t
    strict = _causal_mask(cum.shape[-1], cum.device, strict=True)
    # Within a chunk the delta corrections d_s = beta_s (v_s - S_s'^T k_s) satisfy
    # (I + N) D = beta V - (beta gamma K) S_0, N[t, s] = beta_t (k_t . k_s) exp(cum_t - cum_s) for s < t.
    lower = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)  # D = u - w S_0
    scores = (q @ k.transpose(-1, -2)) * decay  # includes the diagonal
    q_decayed = q * cum.exp()[..., None]
    k_tail = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()
    outputs = []
    for n in range(q.shape[2]):
        delta = u[:, :, n] - w[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + scores[:, :, n] @ delta)
        state = chunk_decay[:, :, n, None, None] * state + k_tail[:, :, n].transpose(-1, -2) @ delta
    return torch.stack(outputs, dim=2), state


def torch_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise gated delta rule. q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV].
    Flags as in fla: l2-normalise q/k (eps 1e-6), beta = sigmoid(beta) (x2 with allow_neg_eigval),
    g = -exp(A_log) * softplus(g + dt_bias). Returns (o in q.dtype, final state [N, HV, K, V])."""
    if beta is not None and beta.dim() == v.dim():
        raise NotImplementedError(
            "torch_chunk_gated_delta_rule supports a head-wise beta [B, T, HV] only; "
            "use torch_fused_recurrent_gated_delta_rule for a per-channel beta [B, T, HV, V]."
        )
    _check_varlen(q, cu_seqlens, initial_state)
    flags = {
        "scale": scale,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
        "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
        "allow_neg_eigval": allow_neg_eigval,
        "state_v_first": state_v_first,
        "use_gate_in_kernel": use_gate_in_kernel,
        "A_log": A_log,
        "dt_bias": dt_bias,
    }
    if cu_seqlens is not None:
        return _run_varlen(
            torch_chunk_gated_delta_rule,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "g": g, "beta": beta},
            initial_state,
            output_final_state,
            **flags,
        )
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    qs, ks, vs, gs, betas = _gdn_inputs(
        q,
        k,
        v,
        g,
        beta,
        scale,
        use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel,
        allow_neg_eigval,
        use_gate_in_kernel,
        A_log,
        dt_bias,
        dtype,
    )
    B, T, HV, V = v.shape
    K = k.shape[-1]
    if gs is None:
        gs = betas.new_zeros(betas.shape)
    state = _to_k_first(initial_state, state_v_first, dtype)
    if state is None:
        state = vs.new_zeros(B, HV, K, V)
    if T == 0:
        o = v.new_zeros(B, 0, HV, V, dtype=q.dtype)
        return o, (_from_k_first(state, state_v_first) if output_final_state else None)
    # heads first, pad to whole chunks (zero key, beta and log decay leave the state untouched)
    qs, ks, vs, gs, betas = (x.transpose(1, 2) for x in (qs, ks, vs, gs, betas))
    C = CHUNK_SIZE
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    qs, ks, vs, gs, betas = (_pad_time(x, pad) for x in (qs, ks, vs, gs, betas))
    qs, ks, vs = (x.reshape(B, HV, num_chunks, C, x.shape[-1]) for x in (qs, ks, vs))
    gs, betas = (x.reshape(B, HV, num_chunks, C) for x in (gs, betas))
    outputs = []
    for a, b in _segments(num_chunks, C):
        o_seg, state = _maybe_checkpoint(
            _gdn_segment, qs[:, :, a:b], ks[:, :, a:b], vs[:, :, a:b], gs[:, :, a:b], betas[:, :, a:b], state
        )
        outputs.append(o_seg)
    o = torch.cat(outputs, dim=2).reshape(B, HV, num_chunks * C, V)[:, :, :T].transpose(1, 2)
    return o.to(q.dtype), (_from_k_first(state, state_v_first) if output_final_state else None)


def torch_fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule (decay first, then the delta update, then the read).
    Optional per-channel decays gk [B, T, HV, K], gv [B, T, HV, V]; beta head-wise [B, T, HV] or
    per channel [B, T, HV, V]. Returns (o in v.dtype, final state)."""
    _check_varlen(q, cu_seqlens, initial_state)
    flags = {
        "scale": scale,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
        "use_gate_in_kernel": use_gate_in_kernel,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
        "allow_neg_eigval": allow_neg_eigval,
        "state_v_first": state_v_first,
    }
    if cu_seqlens is not None:
        return _run_varlen(
            torch_fused_recurrent_gated_delta_rule,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "g": g, "gk": gk, "gv": gv, "beta": beta},
            initial_state,
            output_final_state,
            **flags,
        )
    dtype = _compute_dtype(q, k, v, g, gk, gv, beta, initial_state)
    qs, ks, vs, gs, betas = _gdn_inputs(
        q,
        k,
        v,
        g,
        beta,
        scale,
        use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel,
        allow_neg_eigval,
        use_gate_in_kernel,
        A_log,
        dt_bias,
        dtype,
    )
    B, T, HV, V = v.shape
    K = k.shape[-1]
    if betas.dim() == 3:
        betas = betas[..., None]
    state = _to_k_first(initial_state, state_v_first, dtype)
    if state is None:
        state = vs.new_zeros(B, HV, K, V)
    outputs = []
    for t in range(T):
        if gs is not None:
            state = state * gs[:, t].exp()[..., None, None]
        if gk is not None:
            state = state * gk[:, t].to(dtype).exp()[..., :, None]
        if gv is not None:
            state = state * gv[:, t].to(dtype).exp()[..., None, :]
        k_t = ks[:, t]
        delta = betas[:, t] * (vs[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", qs[:, t], state))
    o = torch.stack(outputs, dim=1) if T > 0 else vs.new_zeros(B, 0, HV, V)
    return o.to(v.dtype), (_from_k_first(state, state_v_first) if output_final_state else None)


# --------------------------------------------------------------------------------------------
# norms, activations, short convolution, losses
# --------------------------------------------------------------------------------------------


def _rms_normalise(x, weight, bias, residual, eps):
    """(x + residual) / rms * weight + bias in the compute dtype; also returns x + residual."""
    dtype = _compute_dtype(x, residual)
    summed = x.to(dtype)
    if residual is not None:
        summed = summed + residual.to(dtype)
    y = summed * torch.rsqrt(summed.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y, summed


def _prenorm_residual(x, residual, summed, residual_in_fp32):
    """The residual stream fla returns with prenorm=True: x + residual in residual's dtype
    (fp32 if residual_in_fp32 and no residual was given, else x itself)."""
    if residual is not None:
        return summed.to(residual.dtype)
    if residual_in_fp32:
        return summed.to(torch.float32)
    return x


def torch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's RMSNorm with the optional fused residual add: y = rmsnorm(x + residual) in x.dtype;
    with prenorm=True returns (y, x + residual)."""
    y, summed = _rms_normalise(x, weight, bias, residual, eps)
    y = y.to(x.dtype)
    return (y, _prenorm_residual(x, residual, summed, residual_in_fp32)) if prenorm else y


def torch_rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's FusedRMSNormGated: rmsnorm(x) * act(g), act = swish/silu (g * sigmoid(g)) or sigmoid."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(
            f"rms_norm_gated: unsupported activation {activation!r}; use 'swish', 'silu' or 'sigmoid'."
        )
    y, summed = _rms_normalise(x, weight, bias, residual, eps)
    gf = g.to(_compute_dtype(g, y))
    y = (y * (gf.sigmoid() if activation == "sigmoid" else F.silu(gf))).to(x.dtype)
    return (y, _prenorm_residual(x, residual, summed, residual_in_fp32)) if prenorm else y


def torch_swish(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x.to(_compute_dtype(x))).to(x.dtype)


def torch_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return x.to(_compute_dtype(x)).sigmoid().to(x.dtype)


def torch_logsigmoid(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return (F.logsigmoid(x.to(_compute_dtype(x))) / temperature).to(x.dtype)


def torch_swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """swish(x) * y, computed in fp32 (or wider), returned in x.dtype."""
    dtype = _compute_dtype(x, y)
    return (F.silu(x.to(dtype)) * y.to(dtype)).to(x.dtype)


def torch_swiglu_linear(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return F.linear(torch_swiglu(x, y), weight, bias)


def _conv_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("swish", "silu"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"causal_conv1d: unsupported activation {activation!r}; use 'silu', 'swish' or None.")


def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv: y_t = act(sum_i w[:, i] x_{t-W+1+i} + b) + residual_t.
    x [B, T, D]; weight [D, W]; initial_state / final state [N, D, W] = the last W inputs
    (index W-1 the most recent), which is what the decode step consumes."""
    if weight is None:
        raise ValueError("torch_causal_conv1d needs a weight of shape [D, W].")
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.reshape(*x.shape[:2], -1)
    _check_varlen(x, cu_seqlens, initial_state)
    if cu_seqlens is not None:

        def one_sequence(x, residual, initial_state, output_final_state, cu_seqlens):
            return torch_causal_conv1d(
                x, weight, bias, residual, initial_state, output_final_state, activation
            )

        y, final = _run_varlen(
            one_sequence, cu_seqlens, {"x": x, "residual": residual}, initial_state, output_final_state
        )
        return y.view(shape), final
    B, T, D = x.shape
    W = weight.shape[1]
    dtype = _compute_dtype(x, weight)
    history = initial_state.to(dtype) if initial_state is not None else x.new_zeros(B, D, W, dtype=dtype)
    full = torch.cat([history, x.to(dtype).transpose(1, 2)], dim=-1)  # [B, D, W + T]
    # y_t = sum_i w_i * input_{t-W+1+i}; input_t sits at column W + t of `full`. W shifted
    # multiply-adds: F.conv1d's depthwise path is orders of magnitude slower in float64.
    w = weight.to(dtype)
    y = sum(w[:, i, None] * full[..., 1 + i : 1 + i + T] for i in range(W)).transpose(1, 2)
    if bias is not None:
        y = y + bias.to(dtype)
    y = _conv_activation(y, activation)
    if residual is not None:
        y = y + residual.reshape(y.shape).to(dtype)
    final = full[..., -W:].to(x.dtype).contiguous() if output_final_state else None
    return y.to(x.dtype).view(shape), final


def torch_causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step per sequence: x [N, D], [N, 1, D] or [1, N, D]; cache [N, D, W] is shifted
    left and x appended IN PLACE (as fla's kernel does), y = act(sum(cache * w) + b) + residual."""
    if weight is None:
        raise ValueError("torch_causal_conv1d_update needs a weight of shape [D, W].")
    shape = x.shape
    D, _W = weight.shape
    dtype = _compute_dtype(x, weight)
    x_new = x.reshape(-1, D).to(dtype)
    window = torch.cat([cache[..., 1:].to(dtype), x_new[..., None]], dim=-1)  # [N, D, W]
    y = (window * weight.to(dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(dtype)
    y = _conv_activation(y, activation)
    if residual is not None:
        y = y + residual.reshape(y.shape).to(dtype)
    with torch.no_grad():
        cache.copy_(window)
    return y.to(x.dtype).view(shape), cache


def torch_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    logit_softcapping: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's cross entropy on [N, V] logits: lse - (1-eps) x_y - eps mean(x) + z-loss, where
    z-loss = lse_square_scale * lse^2 is part of the loss. Returns (loss, z_loss), reduced over the
    non-ignored targets ('mean' / 'sum') or per row ('none'), in fp32 (fp64 for fp64 logits)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    x = logits.to(_compute_dtype(logits)) * logit_scale
    if logit_softcapping is not None:
        x = logit_softcapping * torch.tanh(x / logit_softcapping)
    lse = torch.logsumexp(x, dim=-1)
    valid = target != ignore_index
    target_logit = x.gather(-1, torch.where(valid, target, 0)[:, None]).squeeze(-1)
    loss = lse - (1.0 - label_smoothing) * target_logit
    if label_smoothing > 0:
        loss = loss - label_smoothing * x.mean(-1)
    z_loss = lse_square_scale * lse.square()
    loss = torch.where(valid, loss + z_loss, 0.0)
    z_loss = torch.where(valid, z_loss, 0.0).detach()  # fla: logged, no own backward
    if reduction == "none":
        return loss, z_loss
    loss, z_loss = loss.sum(), z_loss.sum()
    if reduction == "mean":
        count = valid.sum()
        loss, z_loss = loss / count, z_loss / count
    return loss, z_loss


# --------------------------------------------------------------------------------------------
# fla's chunk_bwd_dqkwg in torch (workaround for fla #640 on Hopper, see install_hopper_dqkwg_fix)
# --------------------------------------------------------------------------------------------


def torch_chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    chunk_indices: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """fla.ops.common.chunk_o.chunk_bwd_dqkwg (kernel chunk_bwd_kernel_dqkwg) in plain torch.

    Same signature (argument order q, k, v, do, h, dh, ...) and returns as fla's:
    q, k [B, T, H, K]; v, do, dv [B, T, HV, V]; w [B, T, HV, K]; g [B, T, HV] the chunk-local
    cumulative log decay in log2 units; g_gamma [HV] the per-step log2 decay (ignored when g is
    given, as in the kernel); h / dh [B, NT, HV, K, V] ([.., V, K] if state_v_first): the state at
    the start of chunk n and the gradient of the state at the end of chunk n.
    Returns dq [B, T, H, K] (q.dtype), dk (k.dtype), dw = -(dv @ h^T) (w.dtype, None without w),
    dg [B, T, HV] (None without g): the gradient wrt the cumulative g in natural-log units, before
    fla's within-chunk reverse cumsum; float32 like fla's (float64 for float64 inputs).
    All chunks at once; computed in float32 or wider.
    """
    if cu_seqlens is not None or chunk_indices is not None:
        raise NotImplementedError(
            "torch_chunk_bwd_dqkwg: variable-length inputs (cu_seqlens) are not supported."
        )
    if w is not None and dv is None:
        raise ValueError("torch_chunk_bwd_dqkwg: w (delta rule) needs dv.")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    dtype = _compute_dtype(q, k, v, do, h, dh, w, dv, g, g_gamma)
    if scale is None:
        scale = K**-0.5

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """[B, T, heads, D] -> [B, heads, N, C, D] in the compute dtype, zero-padded tail."""
        x = _pad_time(_heads_first(x, dtype), pad)
        return x.reshape(B, x.shape[1], N, C, x.shape[-1])

    def unchunk(x: torch.Tensor) -> torch.Tensor:
        """[B, heads, N, C, *] -> [B, T, heads, *]."""
        return x.reshape(B, x.shape[1], N * C, *x.shape[4:])[:, :, :T].transpose(1, 2)

    def states(x: torch.Tensor) -> torch.Tensor:
        """[B, N, HV, ., .] -> [B, HV, N, V, K]: V-first, the orientation the kernel loads."""
        x = x.to(dtype).transpose(1, 2)
        return x if state_v_first else x.transpose(-1, -2)

    # value head i uses query/key head i // (HV // H) (grouped value heads)
    qc = chunks(q).repeat_interleave(HV // H, dim=1)
    kc = chunks(k).repeat_interleave(HV // H, dim=1)
    vc, doc = chunks(v), chunks(do)
    hs, dhs = states(h), states(dh)

    # chunk-local log2 decay at every position [.., N, C] and at the last valid one [.., N]
    n_valid = (T - torch.arange(N, device=q.device) * C).clamp(max=C)
    if g is not None:
        gc = _pad_time(g.to(dtype).transpose(1, 2), pad).reshape(B, HV, N, C)
        g_last = gc.gather(-1, (n_valid - 1).expand(B, HV, N)[..., None])[..., 0]
    elif g_gamma is not None:
        gamma = g_gamma.to(dtype)[:, None, None]  # [HV, 1, 1]
        gc = gamma * torch.arange(1, C + 1, device=q.device, dtype=dtype)
        g_last = gamma[..., 0] * n_valid.to(dtype)
    else:
        gc = q.new_zeros(1, 1, N, C, dtype=dtype)
        g_last = gc[..., 0]
    valid = torch.arange(N * C, device=q.device).reshape(N, C) < T
    # exponents masked to -inf before exp2, so padded / acausal entries are exact zeros (no inf * 0)
    decay_k = (g_last[..., None] - gc).masked_fill(~valid, float("-inf")).exp2()
    causal = _causal_mask(C, q.device) & valid[:, :, None] & valid[:, None, :]
    rel = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp2()

    ds = (doc @ vc.transpose(-1, -2)) * rel * scale  # dL/d(intra-chunk scores) [.., C, C]
    dq = (doc @ hs) * (gc.exp2()[..., None] * scale) + ds @ kc
    dk_inter = (vc @ dhs) * decay_k[..., None]
    dk = dk_inter + ds.transpose(-1, -2) @ qc

    dg = None
    if g is not None:
        # d/dg_last of the chunk-end state exp2(g_last) h + sum_i exp2(g_last - g_i) k_i v_i^T
        dg_last = (hs * dhs).sum((-1, -2)) * g_last.exp2() + (dk_inter * kc).sum((-1, -2))
        dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)
        is_last = torch.arange(C, device=q.device) == (n_valid - 1)[:, None]  # [N, C]
        dg = dg + is_last * dg_last[..., None]
        dg = unchunk(dg).contiguous()
    dw = None
    if w is not None:
        dw = unchunk(-(chunks(dv) @ hs)).to(w.dtype).contiguous()

    dq, dk = unchunk(dq), unchunk(dk)
    if H != HV:
        dq = dq.reshape(B, T, H, HV // H, K).sum(3)
        dk = dk.reshape(B, T, H, HV // H, K).sum(3)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dw, dg


# --------------------------------------------------------------------------------------------
# dispatchers with fla's signatures: CUDA -> fla (triton), anything else -> torch
# --------------------------------------------------------------------------------------------


def _fla_ops():
    """The original fla functions, looked up in their defining modules (never patched)."""
    from fla.modules.activations import ops as act_ops
    from fla.modules.causal_conv1d import ops as conv_ops
    from fla.modules.norm import fused_norm_gate, layernorm
    from fla.modules.norm import l2norm as l2norm_mod
    from fla.ops.gated_delta_rule import chunk as gdn_chunk
    from fla.ops.gated_delta_rule import fused_recurrent as gdn_recurrent
    from fla.ops.gla import chunk as gla_chunk
    from fla.ops.gla import fused_recurrent as gla_recurrent
    from fla.ops.simple_gla import chunk as simple_chunk
    from fla.ops.simple_gla import fused_recurrent as simple_recurrent

    return {
        "chunk_gla": gla_chunk.chunk_gla,
        "fused_recurrent_gla": gla_recurrent.fused_recurrent_gla,
        "chunk_simple_gla": simple_chunk.chunk_simple_gla,
        "fused_recurrent_simple_gla": simple_recurrent.fused_recurrent_simple_gla,
        "chunk_gated_delta_rule": gdn_chunk.chunk_gated_delta_rule,
        "fused_recurrent_gated_delta_rule": gdn_recurrent.fused_recurrent_gated_delta_rule,
        "l2norm": l2norm_mod.l2norm,
        "causal_conv1d": conv_ops.causal_conv1d,
        "causal_conv1d_update": conv_ops.causal_conv1d_update,
        "rms_norm": layernorm.rms_norm,
        "rms_norm_gated": fused_norm_gate.rms_norm_gated,
        "swiglu": act_ops.swiglu,
        "swiglu_linear": act_ops.swiglu_linear,
        "swish": act_ops.swish,
        "sigmoid": act_ops.sigmoid,
        "logsigmoid": act_ops.logsigmoid,
    }


_FLA: dict[str, Callable] = {}


def _fla(name: str) -> Callable:
    if not _FLA:
        _FLA.update(_fla_ops())
    return _FLA[name]


def chunk_gla(
    q,
    k,
    v,
    g,
    scale=None,
    initial_state=None,
    output_final_state=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
):
    if q.is_cuda:
        return _fla("chunk_gla")(
            q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu
        )
    return torch_chunk_gla(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens)


def fused_recurrent_gla(
    q,
    k,
    v,
    gk=None,
    gv=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    reverse=False,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    if q.is_cuda:
        return _fla("fused_recurrent_gla")(
            q,
            k,
            v,
            gk,
            gv,
            scale,
            initial_state,
            output_final_state,
            reverse,
            state_v_first,
            cu_seqlens,
            **kwargs,
        )
    return torch_fused_recurrent_gla(
        q, k, v, gk, gv, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens
    )


def chunk_simple_gla(
    q,
    k,
    v,
    g=None,
    g_gamma=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    **kwargs,
):
    if q.is_cuda:
        return _fla("chunk_simple_gla")(
            q,
            k,
            v,
            g,
            g_gamma,
            scale,
            initial_state,
            output_final_state,
            state_v_first,
            cu_seqlens,
            cu_seqlens_cpu,
            **kwargs,
        )
    return torch_chunk_simple_gla(
        q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens
    )


def fused_recurrent_simple_gla(
    q,
    k,
    v,
    g=None,
    g_gamma=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    reverse=False,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    if q.is_cuda:
        return _fla("fused_recurrent_simple_gla")(
            q,
            k,
            v,
            g,
            g_gamma,
            scale,
            initial_state,
            output_final_state,
            reverse,
            state_v_first,
            cu_seqlens,
            **kwargs,
        )
    return torch_fused_recurrent_simple_gla(
        q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens
    )


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    if q.is_cuda:
        return _fla("chunk_gated_delta_rule")(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices,
            cp_context=cp_context,
            **kwargs,
        )
    if cp_context is not None:
        raise NotImplementedError(
            "chunk_gated_delta_rule on CPU: context parallelism (cp_context) is CUDA-only."
        )
    return torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        use_gate_in_kernel=kwargs.get("use_gate_in_kernel", False),
        A_log=kwargs.get("A_log"),
        dt_bias=kwargs.get("dt_bias"),
    )


def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g=None,
    gk=None,
    gv=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    args = {
        "g": g,
        "gk": gk,
        "gv": gv,
        "beta": beta,
        "scale": scale,
        "initial_state": initial_state,
        "output_final_state": output_final_state,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
        "use_gate_in_kernel": use_gate_in_kernel,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
        "allow_neg_eigval": allow_neg_eigval,
        "state_v_first": state_v_first,
        "cu_seqlens": cu_seqlens,
    }
    if q.is_cuda:
        return _fla("fused_recurrent_gated_delta_rule")(q, k, v, **args, **kwargs)
    return torch_fused_recurrent_gated_delta_rule(q, k, v, **args)


def l2norm(x, eps=1e-6, output_dtype=None):
    if x.is_cuda:
        return _fla("l2norm")(x, eps, output_dtype)
    return torch_l2norm(x, eps, output_dtype)


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    if x.is_cuda:
        return _fla("rms_norm")(x, weight, bias, residual, eps, prenorm, residual_in_fp32)
    return torch_rms_norm(x, weight, bias, residual, eps, prenorm, residual_in_fp32)


def rms_norm_gated(
    x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False, eps=1e-6
):
    if x.is_cuda:
        return _fla("rms_norm_gated")(
            x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps
        )
    return torch_rms_norm_gated(x, g, weight, bias, activation, residual, eps, prenorm, residual_in_fp32)


def causal_conv1d(
    x,
    weight=None,
    bias=None,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    backend="triton",
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    if x.is_cuda:
        return _fla("causal_conv1d")(
            x,
            weight,
            bias,
            residual,
            initial_state,
            output_final_state,
            activation,
            backend,
            cu_seqlens,
            cu_seqlens_cpu,
            chunk_indices,
            cp_context,
            **kwargs,
        )
    if cp_context is not None:
        raise NotImplementedError("causal_conv1d on CPU: context parallelism (cp_context) is CUDA-only.")
    return torch_causal_conv1d(
        x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens
    )


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    if x.is_cuda:
        return _fla("causal_conv1d_update")(x, cache, residual, weight, bias, activation)
    return torch_causal_conv1d_update(x, cache, residual, weight, bias, activation)


def swiglu(x, y):
    return _fla("swiglu")(x, y) if x.is_cuda else torch_swiglu(x, y)


def swiglu_linear(x, y, weight, bias):
    return _fla("swiglu_linear")(x, y, weight, bias) if x.is_cuda else torch_swiglu_linear(x, y, weight, bias)


def swish(x):
    return _fla("swish")(x) if x.is_cuda else torch_swish(x)


def sigmoid(x):
    return _fla("sigmoid")(x) if x.is_cuda else torch_sigmoid(x)


def logsigmoid(x, temperature=1.0):
    return _fla("logsigmoid")(x, temperature) if x.is_cuda else torch_logsigmoid(x, temperature)


def _cpu_unsupported(name: str, original: Callable) -> Callable:
    def wrapper(x, *args, **kwargs):
        if x.is_cuda:
            return original(x, *args, **kwargs)
        raise NotImplementedError(
            f"fla's {name} is triton-only and ccq_eval.backend has no CPU version of it; "
            "use hidden_act='swish' for GatedMLP on CPU."
        )

    return wrapper


# --------------------------------------------------------------------------------------------
# module forwards (CPU branch only; CUDA calls the original forward)
# --------------------------------------------------------------------------------------------


def _short_conv_forward_cpu(
    self,
    x,
    residual=None,
    mask=None,
    cache=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_indices=None,
    **kwargs,
):
    """ShortConvolution.forward on CPU, following fla's control flow: a no-grad call with one token
    per sequence is a decode step that updates `cache` in place; anything else is a full conv."""
    if kwargs.get("cp_context") is not None:
        raise NotImplementedError("ShortConvolution on CPU: context parallelism (cp_context) is CUDA-only.")
    B, T = x.shape[:2]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if mask is not None:
        if cu_seqlens is not None:
            raise ValueError("ShortConvolution: pass either mask or cu_seqlens, not both.")
        x = x * mask.unsqueeze(-1)
    weight = self.weight.squeeze(1)  # [D, 1, W] -> [D, W]
    single_token = B * T == N and (cu_seqlens is None or bool((cu_seqlens.diff() == 1).all()))
    if not torch.is_grad_enabled() and single_token:
        if cache is None:
            cache = x.new_zeros(N, x.shape[-1], weight.shape[1])
        y, cache = torch_causal_conv1d_update(x, cache, residual, weight, self.bias, self.activation)
        return y, (cache if output_final_state else None)
    return torch_causal_conv1d(
        x, weight, self.bias, residual, cache, output_final_state, self.activation, cu_seqlens
    )


def _rms_norm_forward_cpu(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    return torch_rms_norm(x, self.weight, self.bias, residual, self.eps, prenorm, residual_in_fp32)


def _rms_norm_gated_forward_cpu(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    return torch_rms_norm_gated(
        x, g, self.weight, self.bias, self.activation, residual, self.eps, prenorm, residual_in_fp32
    )


def _l2norm_forward_cpu(self, x):
    return torch_l2norm(x, self.eps, self.output_dtype)


def _cross_entropy_forward_cpu(self, input, target):
    if self.process_group is not None:
        raise NotImplementedError(
            "FusedCrossEntropyLoss on CPU: a vocabulary-parallel process_group is CUDA-only."
        )
    loss, z_loss = torch_cross_entropy(
        input,
        target,
        ignore_index=self.ignore_index,
        reduction=self.reduction,
        label_smoothing=self.label_smoothing,
        logit_scale=self.logit_scale,
        lse_square_scale=self.lse_square_scale,
        logit_softcapping=self.logit_softcapping,
    )
    return (loss, z_loss) if self.return_z_loss else loss


def _linear_cross_entropy_forward_cpu(self, x, target, weight, bias=None):
    if self.process_group is not None:
        raise NotImplementedError(
            "FusedLinearCrossEntropyLoss on CPU: a vocabulary-parallel process_group is CUDA-only."
        )
    from fla.modules.l2warp import L2Wrap

    logits = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    loss, _ = torch_cross_entropy(
        logits,
        target.reshape(-1),
        ignore_index=self.ignore_index,
        reduction=self.reduction,
        label_smoothing=self.label_smoothing,
        logit_scale=self.logit_scale,
        logit_softcapping=self.logit_softcapping,
    )
    if self.use_l2warp:
        # fla normalises the penalty by the number of input tokens: logits viewed as [1, N, V]
        loss = L2Wrap.apply(loss, logits[None], self.l2_penalty_factor)
    return loss


def _device_dispatching(original: Callable, cpu_forward: Callable, tensor_arg: str) -> Callable:
    """A forward that calls `original` when its first tensor argument is on CUDA, else `cpu_forward`."""

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs[tensor_arg]
        if x.is_cuda:
            return original(self, *args, **kwargs)
        return cpu_forward(self, *args, **kwargs)

    forward.__name__ = original.__name__
    forward.__doc__ = original.__doc__
    forward._ccq_original = original
    return forward


# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------

_PATCHED_FUNCTIONS: list[tuple[str, str]] = [
    # (module, name): the names fla's GLA / Gated DeltaNet layers and GatedMLP call at run time
    ("fla.layers.gla", "chunk_gla"),
    ("fla.layers.gla", "fused_recurrent_gla"),
    ("fla.layers.gated_deltanet", "chunk_gated_delta_rule"),
    ("fla.layers.gated_deltanet", "fused_recurrent_gated_delta_rule"),
    ("fla.layers.gated_deltanet", "causal_conv1d"),
    ("fla.modules.mlp", "swiglu"),
    ("fla.modules.mlp", "swiglu_linear"),
]


def _patched_classes():
    from fla.modules import (
        FusedCrossEntropyLoss,
        FusedLinearCrossEntropyLoss,
        FusedRMSNormGated,
        L2Norm,
        RMSNorm,
        ShortConvolution,
    )

    return [
        (RMSNorm, _rms_norm_forward_cpu, "x"),
        (FusedRMSNormGated, _rms_norm_gated_forward_cpu, "x"),
        (ShortConvolution, _short_conv_forward_cpu, "x"),
        (L2Norm, _l2norm_forward_cpu, "x"),
        (FusedCrossEntropyLoss, _cross_entropy_forward_cpu, "input"),
        (FusedLinearCrossEntropyLoss, _linear_cross_entropy_forward_cpu, "x"),
    ]


# The fla modules whose backward calls chunk_bwd_dqkwg by its module-level name and that our
# models reach (fla.ops.gla's backward has its own kernels and never calls it).
_DQKWG_CALLERS = ("fla.ops.gated_delta_rule.chunk", "fla.ops.simple_gla.chunk")


def _hits_fla_640(q: torch.Tensor, g: torch.Tensor | None) -> bool:
    """The guard in fla's chunk_bwd_dqkwg, on CUDA tensors: it raises exactly then."""
    from fla.ops.common import chunk_o

    return (
        q.is_cuda
        and g is not None
        and chunk_o.IS_NVIDIA_HOPPER
        and chunk_o.TRITON_ABOVE_3_4_0
        and not chunk_o.TRITON_ABOVE_3_7_1
    )


def _hopper_dqkwg(original: Callable) -> Callable:
    def chunk_bwd_dqkwg(
        q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
        state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None,
    ):
        fn = torch_chunk_bwd_dqkwg if _hits_fla_640(q, g) else original
        return fn(
            q, k, v, do, h, dh, w=w, g=g, g_gamma=g_gamma, dv=dv, scale=scale, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices,
        )

    chunk_bwd_dqkwg._ccq_original = original
    return chunk_bwd_dqkwg


def install_hopper_dqkwg_fix() -> None:
    """Route fla's gated chunk_bwd_dqkwg to torch_chunk_bwd_dqkwg where fla refuses it.

    fla #640: on Hopper with 3.4.0 <= Triton < 3.7.1 chunk_bwd_kernel_dqkwg gives wrong results and
    fla 0.6.0 raises instead, which breaks the backward of chunk_gated_delta_rule / chunk_simple_gla
    on our H200. Patches the name in _DQKWG_CALLERS; everything else still calls fla (idempotent).
    """
    import importlib

    from fla.ops.common import chunk_o

    for module_name in _DQKWG_CALLERS:
        # wrap fla's own function (from its defining module, never patched): idempotent
        module = importlib.import_module(module_name)
        module.chunk_bwd_dqkwg = _hopper_dqkwg(chunk_o.chunk_bwd_dqkwg)


def install() -> None:
    """Make fla's GLA / Gated DeltaNet models run on CPU; CUDA tensors still use fla's kernels.

    Patches (idempotent; safe to call many times):
    - the op names fla.layers.gla / fla.layers.gated_deltanet / fla.modules.mlp call (see
      _PATCHED_FUNCTIONS) with this module's dispatchers;
    - forward of RMSNorm, FusedRMSNormGated (and subclasses), ShortConvolution, L2Norm,
      FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss;
    - fla's ACT2FN entries swish / silu / sigmoid / logsigmoid (layers read ACT2FN when they are
      constructed, so call install() before building a model);
    - GatedMLP's powglu / powglu_linear: a clear error on CPU instead of a triton failure;
    - chunk_bwd_dqkwg in fla's gated delta rule / simple GLA (install_hopper_dqkwg_fix).
    """
    import importlib

    from fla.modules.activations import ops as act_ops

    this = globals()
    for module_name, name in _PATCHED_FUNCTIONS:
        setattr(importlib.import_module(module_name), name, this[name])

    mlp = importlib.import_module("fla.modules.mlp")
    for name in ("powglu", "powglu_linear"):
        original = getattr(act_ops, name)
        setattr(mlp, name, _cpu_unsupported(name, original))

    for key, fn in (("swish", swish), ("silu", swish), ("sigmoid", sigmoid), ("logsigmoid", logsigmoid)):
        act_ops.ACT2FN[key] = fn

    for cls, cpu_forward, tensor_arg in _patched_classes():
        current = cls.__dict__["forward"]
        original = getattr(current, "_ccq_original", current)
        cls.forward = _device_dispatching(original, cpu_forward, tensor_arg)

    install_hopper_dqkwg_fix()


def is_installed() -> bool:
    import fla.layers.gla

    return fla.layers.gla.chunk_gla is chunk_gla


__all__ = [
    "CHUNK_SIZE",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_simple_gla",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_simple_gla",
    "install",
    "install_hopper_dqkwg_fix",
    "is_installed",
    "l2norm",
    "logsigmoid",
    "rms_norm",
    "rms_norm_gated",
    "sigmoid",
    "swiglu",
    "swiglu_linear",
    "swish",
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
    "torch_rms_norm",
    "torch_rms_norm_gated",
    "torch_swiglu",
    "torch_swiglu_linear",
]
