"""Linear attention with per-channel decay (GLA) and scalar decay (simple GLA) in torch, chunkwise and
recurrent, with fla's signatures and return conventions.

Linear attention with per-step log decay g_t: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,
o_t = S_t^T (scale * q_t). Chunkwise: intra-chunk attention with relative decays plus a scan over
chunk states (memory O(T * C) plus one state per chunk, never a T x T matrix).
"""

from __future__ import annotations

import torch

from ccq_eval.model.fla_cpu.common import (
    GLA_SUB_BLOCK,
    causal_mask,
    check_varlen,
    chunk_size_for,
    compute_dtype,
    from_k_first,
    heads_first,
    maybe_checkpoint,
    pad_time,
    relative_decay,
    run_varlen,
    scan_chunk_states,
    segment_ranges,
    to_k_first,
)


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
        mask = causal_mask(cum_b.shape[-2], q.device)[..., None]
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
    starts, state = scan_chunk_states(state, chunk_decay, chunk_update)
    o = o + (q * cum.exp()) @ starts
    return o, state


def _scalar_decay_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor
):
    """One segment of chunkwise linear attention with a scalar (per head) log decay.
    q (pre-scaled), k: [B, H, N, C, K]; v [B, H, N, C, V]; g [B, H, N, C]; state [B, H, K, V]."""
    cum = g.cumsum(-1)
    o = ((q @ k.transpose(-1, -2)) * relative_decay(cum)) @ v
    last = cum[..., -1:]
    chunk_update = (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ v
    chunk_decay = last.exp()[..., None]  # [.., N, 1, 1]
    starts, state = scan_chunk_states(state, chunk_decay, chunk_update)
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
    C = chunk_size_for(T)
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    q, k, v, g = (pad_time(x, pad) for x in (q, k, v, g))
    q, k, v = (x.reshape(B, H, num_chunks, C, x.shape[-1]) for x in (q, k, v))
    g = g.reshape(B, H, num_chunks, C, K) if per_channel else g.reshape(B, H, num_chunks, C)
    segment_fn = _gla_segment if per_channel else _scalar_decay_segment
    outputs = []
    for a, b in segment_ranges(num_chunks, C):
        o_seg, state = maybe_checkpoint(
            segment_fn, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], g[:, :, a:b], state
        )
        outputs.append(o_seg)
    o = torch.cat(outputs, dim=2).reshape(B, H, num_chunks * C, V)[:, :, :T]
    return o, state


def _chunk_op(q, k, v, g, scale, initial_state, output_final_state, state_v_first, dtype, per_channel):
    """What chunk_gla and chunk_simple_gla share: [B, T, H, *] layout in and out, the initial and
    final state in fla's layout, o in v.dtype."""
    B, _, H, K = q.shape
    state = to_k_first(initial_state, state_v_first, dtype)
    if state is None:
        state = q.new_zeros(B, H, K, v.shape[-1], dtype=dtype)
    o, state = _chunked_linear_attention(
        heads_first(q, dtype) * scale, heads_first(k, dtype), heads_first(v, dtype), heads_first(g, dtype),
        state, per_channel=per_channel,
    )
    return o.transpose(1, 2).to(v.dtype), (from_k_first(state, state_v_first) if output_final_state else None)


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
    check_varlen(q, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return run_varlen(
            torch_chunk_gla,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "g": g},
            initial_state,
            output_final_state,
            scale=scale,
            state_v_first=state_v_first,
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v, g, initial_state)
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
    check_varlen(q, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return run_varlen(
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
    dtype = compute_dtype(q, k, v, g, g_gamma, initial_state)
    B, T, H, _ = q.shape
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
    check_varlen(q, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return run_varlen(
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
    dtype = compute_dtype(q, k, v, gk, gv, g, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    state = to_k_first(initial_state, state_v_first, dtype)
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
    return o.to(q.dtype), (from_k_first(state, state_v_first) if output_final_state else None)


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
