"""Torch versions of fla's ops for the rwkv7 layers (fla 0.6), and of the modules an RWKV7 model adds.

OPS: fla op name -> FlaOp (merged into dispatch.OPS; a layer whose code looks the name up gets the
dispatcher bound in its place). MODULE_FORWARDS: "fla.module.path:Class" -> (torch forward, name of the
tensor argument that decides the device) (merged into the backend's module table).

The recurrence (fla's diagonal-plus-low-rank delta rule that chunk_rwkv7 and the fused recurrent forms
run), per head with a K-first state S [K, V] and w the log decay (<= 0):

    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,    o_t = S_t^T (scale * r_t)

(the low-rank term reads the state before this step's decay; in the V-first view S^T this is
S_t = S_{t-1} (diag(exp(w_t)) + a_t b_t^T) + v_t k_t^T). The RWKV7 layer passes a = -kk, b = kk * a_gate.

Chunkwise form (exact; chunks of common.CHUNK_SIZE, smaller for short inputs): with G_t the running sum
of w inside a chunk (inclusive) and u_t = a_t^T S_{t-1}, every u_t is linear in the chunk's start state S_0
and in the values:
    u_t - sum_{s<t} A_ab[t, s] u_s = (a_t * exp(G_{t-1}))^T S_0 + sum_{s<t} A_ak[t, s] v_s^T,
a unit lower triangular system, so U = U_v + W S_0. Then o = (r exp(G) + A_rb W) S_0 + A_rk V + A_rb U_v and
the chunk maps S_0 to (diag(exp(G_C)) + B~^T W) S_0 + K~^T V + B~^T U_v (K~, B~ decayed to the chunk end);
only this K x K map runs sequentially. Every A[t, s] = sum_j x_tj y_sj exp(gx_tj - G_sj) is one matmul per
chunk where the chunk's decays are moderate (RWKV7's always are), else built from exponents <= 0 only, so
no decay, however strong, overflows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from itertools import pairwise

import torch

from ccq_eval.model.fla_cpu.common import (
    GLA_SUB_BLOCK,
    FlaOp,
    causal_mask,
    check_varlen,
    chunk_size_for,
    compute_dtype,
    heads_first,
    maybe_checkpoint,
    pad_time,
    run_varlen,
    segment_ranges,
)
from ccq_eval.model.fla_cpu.delta_rule import torch_l2norm
from ccq_eval.model.fla_cpu.modules import _prenorm_residual

# --------------------------------------------------------------------------------------------
# the recurrence: chunkwise and token by token
# --------------------------------------------------------------------------------------------


# Largest spread of the running log decay within one chunk (max - min over positions, per channel) for
# which the chunk-wide factorisation below keeps every exp() within range: its exponents are at most half
# the spread (e^30 in float32, e^300 in float64). RWKV7's decay bound (w >= -exp(-0.5)) keeps a 64-token
# chunk's spread under 39.
FACTOR_SPREAD = {torch.float32: 60.0, torch.float64: 600.0}


def _decayed_scores(x, gx, ys, gy, strict, ref):
    """A[t, s] = sum_j x_tj y_sj exp(gx_tj - gy_sj) for s <= t (s < t if strict), else 0, for each y in ys.

    x, gx, y, gy: [..., C, K]. With `ref` ([..., 1, K], the middle of the range of gx and gy, whose spread is
    within FACTOR_SPREAD) the exponent is split as (gx - ref) + (ref - gy), one matmul per chunk. Without,
    only exponents <= 0 are used (gy is a running sum of log decays and gx_t <= gy_s on the pairs kept):
    pairs inside one sub-block take the elementwise exponent, pairs further apart factor through the gy just
    before the later sub-block; right for any decay, however strong.
    """
    C = x.shape[-2]
    if ref is not None:
        drop = ~causal_mask(C, x.device, strict)
        x_ref = x * (gx - ref).exp()
        from_ref = (ref - gy).exp()
        return [(x_ref @ (y * from_ref).transpose(-1, -2)).masked_fill(drop, 0.0) for y in ys]
    sub = min(GLA_SUB_BLOCK, C)
    scores = [x.new_zeros(*x.shape[:-1], C) for _ in ys]
    for start in range(0, C, sub):
        rows = slice(start, start + sub)
        size = min(sub, C - start)
        diff = gx[..., rows, None, :] - gy[..., None, rows, :]  # [..., S, S, K]
        keep = causal_mask(size, x.device, strict)[..., None]
        x_decayed = x[..., rows, None, :] * diff.masked_fill(~keep, float("-inf")).exp()
        for score, y in zip(scores, ys, strict=True):
            score[..., rows, rows] = (x_decayed * y[..., None, rows, :]).sum(-1)
        if start > 0:
            edge = gy[..., start - 1 : start, :]
            x_edge = x[..., rows, :] * (gx[..., rows, :] - edge).exp()
            to_edge = (edge - gy[..., :start, :]).exp()
            for score, y in zip(scores, ys, strict=True):
                score[..., rows, :start] = x_edge @ (y[..., :start, :] * to_edge).transpose(-1, -2)
    return scores


def _dplr_segment(q, k, v, a, b, g, state):
    """One segment of the chunkwise recurrence. q (pre-scaled), k, a, b, g: [B, H, N, C, K]; v [B, H, N, C, V];
    state [B, H, K, V]. Returns o [B, H, N, C, V] and the state after the segment."""
    V = v.shape[-1]
    cum = g.cumsum(-2)  # log decay from the chunk start to t, inclusive
    cum_before = cum - g  # ... up to t - 1
    # the range of cum and cum_before (which adds the chunk start, 0) per chunk and channel
    with torch.no_grad():
        high, low = cum.amax(-2, keepdim=True).clamp(min=0), cum.amin(-2, keepdim=True).clamp(max=0)
        factor = bool((high - low).max() <= FACTOR_SPREAD.get(cum.dtype, 0.0))
        ref = (high + low) / 2 if factor else None
    A_qk, A_qb = _decayed_scores(q, cum, (k, b), cum, False, ref)
    A_ak, A_ab = _decayed_scores(a, cum_before, (k, b), cum, True, ref)
    # (I - A_ab) U = A_ak V + (a exp(cum_before)) S_0; the solver reads only the strict lower part.
    rhs = torch.cat([A_ak @ v, a * cum_before.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(-A_ab, rhs, upper=False, unitriangular=True)
    u_values, u_state = solved.split([V, solved.shape[-1] - V], dim=-1)  # U = u_values + u_state S_0
    last = cum[..., -1:, :]
    to_end = (last - cum).exp()
    b_end_t = (b * to_end).transpose(-1, -2)
    transition = torch.diag_embed(last.squeeze(-2).exp()) + b_end_t @ u_state  # [B, H, N, K, K]
    update = (k * to_end).transpose(-1, -2) @ v + b_end_t @ u_values  # [B, H, N, K, V]
    starts = []
    for n in range(q.shape[2]):
        starts.append(state)
        state = transition[:, :, n] @ state + update[:, :, n]
    starts = torch.stack(starts, dim=2)
    o = (q * cum.exp() + A_qb @ u_state) @ starts + A_qk @ v + A_qb @ u_values
    return o, state


def _dplr_chunks(q, k, v, a, b, g, state):
    """The chunkwise recurrence over heads-first inputs [B, H, T, *] in the compute dtype (q pre-scaled);
    state [B, H, K, V]. Pads to whole chunks (zero inputs and log decays leave the state as it is) and runs
    segment by segment, checkpointed under autograd. Returns o [B, H, T, V] and the final state."""
    B, H, T, _ = q.shape
    V = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, H, 0, V), state
    C = chunk_size_for(T)
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    q, k, v, a, b, g = (pad_time(x, pad).reshape(B, H, num_chunks, C, x.shape[-1]) for x in (q, k, v, a, b, g))
    outputs = []
    for lo, hi in segment_ranges(num_chunks, C):
        o_seg, state = maybe_checkpoint(
            _dplr_segment, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], a[:, :, lo:hi], b[:, :, lo:hi],
            g[:, :, lo:hi], state,
        )
        outputs.append(o_seg)
    return torch.cat(outputs, dim=2).reshape(B, H, num_chunks * C, V)[:, :, :T], state


def _dplr_steps(q, k, v, a, b, g, state):
    """The recurrence token by token over heads-first inputs [B, H, T, *] (q pre-scaled); state [B, H, K, V]."""
    B, H, T, _ = q.shape
    outputs = []
    for t in range(T):
        low_rank = b[:, :, t, :, None] * (a[:, :, t, None, :] @ state)  # b_t (a_t^T S_{t-1})
        state = g[:, :, t, :, None].exp() * state + low_rank + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append((q[:, :, t, None, :] @ state).squeeze(-2))
    o = torch.stack(outputs, dim=2) if T > 0 else v.new_zeros(B, H, 0, v.shape[-1])
    return o, state


def _dplr(r, w, k, v, a, b, scale, initial_state, output_final_state, reverse, chunked, dtype):
    """[B, T, H, *] in, o [B, T, H, V] in v.dtype out, states [N, H, K, V] in the compute dtype."""
    B, _, H, K = k.shape
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, a, b, g = (heads_first(x, dtype) for x in (r, k, v, a, b, w))
    q = q * scale
    if reverse:
        q, k, v, a, b, g = (x.flip(2) for x in (q, k, v, a, b, g))
    state = initial_state.to(dtype) if initial_state is not None else q.new_zeros(B, H, K, v.shape[-1])
    o, state = (_dplr_chunks if chunked else _dplr_steps)(q, k, v, a, b, g, state)
    if reverse:
        o = o.flip(2)
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


def _check_shapes(name, r, w, k, v, a, b):
    for label, x in (("r", r), ("w", w), ("a", a), ("b", b)):
        if x.shape != k.shape:
            raise ValueError(f"{name}: {label} must be [B, T, H, K] like k {tuple(k.shape)}, got {tuple(x.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{name}: v must be [B, T, H, V] matching k's {tuple(k.shape[:3])}, got {tuple(v.shape)}")


def torch_chunk_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise RWKV7 / DPLR delta rule (module docstring). r, w (log decay), k, a, b [B, T, H, K];
    v [B, T, H, V]; initial_state [N, H, K, V]. Returns (o in v.dtype, final state or None)."""
    _check_shapes("chunk_rwkv7", r, w, k, v, a, b)
    check_varlen(r, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return run_varlen(torch_chunk_rwkv7, cu_seqlens, {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b},
                          initial_state, output_final_state, scale=scale)
    dtype = compute_dtype(r, w, k, v, a, b, initial_state)
    return _dplr(r, w, k, v, a, b, scale, initial_state, output_final_state, False, True, dtype)


def torch_fused_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same recurrence token by token (fla's default scale here is K^-0.5)."""
    _check_shapes("fused_recurrent_rwkv7", r, w, k, v, a, b)
    check_varlen(r, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return run_varlen(torch_fused_recurrent_rwkv7, cu_seqlens,
                          {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b},
                          initial_state, output_final_state, scale=scale)
    dtype = compute_dtype(r, w, k, v, a, b, initial_state)
    return _dplr(r, w, k, v, a, b, scale, initial_state, output_final_state, False, False, dtype)


def torch_fused_mul_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
    scale: float | None = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token RWKV7 with the layer's low-rank factors formed inside: a -> -kk, b -> kk * a.
    reverse=True runs each sequence from its last token to its first."""
    _check_shapes("fused_mul_recurrent_rwkv7", r, w, k, v, kk, a)
    check_varlen(r, cu_seqlens, initial_state)
    if cu_seqlens is not None:
        return run_varlen(torch_fused_mul_recurrent_rwkv7, cu_seqlens,
                          {"r": r, "w": w, "k": k, "v": v, "kk": kk, "a": a},
                          initial_state, output_final_state, scale=scale, reverse=reverse)
    dtype = compute_dtype(r, w, k, v, kk, a, initial_state)
    kk_c = kk.to(dtype)
    return _dplr(r, w, k, v, -kk_c, kk_c * a.to(dtype), scale, initial_state, output_final_state, reverse,
                 False, dtype)


# --------------------------------------------------------------------------------------------
# the layer's elementwise ops
# --------------------------------------------------------------------------------------------


def torch_token_shift(
    x: torch.Tensor,
    cu_seqlens: torch.LongTensor | None = None,
    cache: torch.Tensor | None = None,
    output_cache: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """delta_t = x_{t-1} - x_t per sequence, x_{-1} = cache (the previous call's last token, [N, D]) or 0.
    x [B, T, D] ([1, total, D] with cu_seqlens). With output_cache also returns each sequence's last
    token [N, D] (the cache unchanged for an empty sequence)."""
    if x.dim() != 3:
        raise ValueError(f"token_shift: x must be [B, T, D], got {tuple(x.shape)}")
    B, T, D = x.shape
    if cu_seqlens is None:
        N, starts, lengths = B, [i * T for i in range(B)], [T] * B
    else:
        if B != 1:
            raise ValueError(f"token_shift: cu_seqlens needs the batch size to be 1, got {B}")
        bounds = [int(i) for i in cu_seqlens.tolist()]
        N, starts = len(bounds) - 1, bounds[:-1]
        lengths = [end - start for start, end in pairwise(bounds)]
    dtype = compute_dtype(x, cache)
    rows = x.to(dtype).reshape(B * T, D)
    first = cache.reshape(N, D).to(dtype) if cache is not None else rows.new_zeros(N, D)
    live = [i for i in range(N) if lengths[i] > 0]
    # each row's predecessor; the first row of every (non-empty) sequence takes its sequence's `first`
    prev = torch.cat([rows.new_zeros(1, D), rows])[:-1]
    prev = prev.index_copy(0, torch.tensor([starts[i] for i in live], dtype=torch.long, device=x.device), first[live])
    delta = (prev - rows).to(x.dtype).reshape(x.shape)
    if not output_cache:
        return delta
    last = first.clone()
    last[live] = rows[[starts[i] + lengths[i] - 1 for i in live]]
    return delta, last.to(x.dtype)


def torch_fused_addcmul_rwkv7(
    hidden_states: torch.Tensor,
    delta: torch.Tensor,
    xr: torch.Tensor,
    xw: torch.Tensor,
    xk: torch.Tensor,
    xv: torch.Tensor,
    xa: torch.Tensor,
    xg: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """hidden + delta * x_* for the six RWKV7 mixes (the last is None without xg), in hidden's dtype."""
    dtype = compute_dtype(hidden_states, delta, xr, xw, xk, xv, xa, xg)
    h, d = hidden_states.to(dtype), delta.to(dtype)
    mixes = [None if x is None else torch.addcmul(h, d, x.to(dtype)).to(hidden_states.dtype)
             for x in (xr, xw, xk, xv, xa, xg)]
    return tuple(mixes)


def torch_fused_k_rwkv7(k: torch.Tensor, a: torch.Tensor, ka: torch.Tensor) -> torch.Tensor:
    """RWKV7's key update k * (1 + (a - 1) * ka), in k's dtype."""
    dtype = compute_dtype(k, a, ka)
    kf = k.to(dtype)
    return (kf * (1 + (a.to(dtype) - 1) * ka.to(dtype))).to(k.dtype)


def torch_gate_output_correction(
    o: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    r_k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
) -> torch.Tensor:
    """(o + (sum_d r * k * r_k) v) * g: o, g [B, T, H * V]; r, k [B, T, H, K]; r_k [H, K]; v [B, T, H, V].
    Returns o's dtype."""
    dtype = compute_dtype(o, r, k, r_k, v, g)
    bonus = (r.to(dtype) * k.to(dtype) * r_k.to(dtype)).sum(-1, keepdim=True) * v.to(dtype)
    return ((o.to(dtype) + bonus.reshape(o.shape)) * g.to(dtype)).to(o.dtype)


# --------------------------------------------------------------------------------------------
# module forwards: fla's LayerNorm / GroupNorm (fuse_norm=True), the RWKV7 feed-forward
# --------------------------------------------------------------------------------------------


def torch_group_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False,
                     is_rms_norm=False, num_groups=1):
    """fla's layer / group norm with the optional fused residual add: each of num_groups channel groups of
    x + residual normalised on its own (mean removed unless is_rms_norm), then weight and bias. y in x's
    dtype; with prenorm=True returns (y, x + residual) as fla does."""
    D = x.shape[-1]
    if D % num_groups:
        raise ValueError(f"group norm: {D} channels do not split into {num_groups} groups")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"group norm: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    dtype = compute_dtype(x, residual, weight, bias)
    summed = x.to(dtype)
    if residual is not None:
        summed = summed + residual.to(dtype)
    y = summed.reshape(*x.shape[:-1], num_groups, D // num_groups)
    if not is_rms_norm:
        y = y - y.mean(-1, keepdim=True)
    y = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)).reshape(x.shape)
    if weight is not None:
        y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    y = y.to(x.dtype)
    return (y, _prenorm_residual(x, residual, summed, residual_in_fp32)) if prenorm else y


def _layer_norm_forward_cpu(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    return torch_group_norm(x, self.weight, self.bias, residual, self.eps, prenorm, residual_in_fp32)


def _group_norm_forward_cpu(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    return torch_group_norm(x, self.weight, self.bias, residual, self.eps, prenorm, residual_in_fp32,
                            self.is_rms_norm, self.num_groups)


def torch_sqrelu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 in the compute dtype, returned in x's dtype (fla's sqrelu rounds through float32 always)."""
    return torch.relu(x.to(compute_dtype(x))).square().to(x.dtype)


@cache
def _fla_sqrelu() -> Callable:
    from fla.modules.activations import ACT2FN

    return ACT2FN["sqrelu"]


def _rwkv7_ffn_forward_cpu(self, x, attention_mask=None, state=None, cu_seqlens=None, **kwargs):
    """RWKV7FeedForward.forward on CPU: fla's control flow with the torch token shift and squared ReLU
    in place of fla's sqrelu (a torch.compile'd function that rounds through float32) as act_fn."""
    act = torch_sqrelu if self.act_fn == _fla_sqrelu() else self.act_fn
    if attention_mask is not None:
        x = x.mul(attention_mask[:, -x.shape[-2]:, None])
    cache = state[self.layer_idx]["ffn_state"] if state is not None else None
    delta, ffn_state = torch_token_shift(x, cu_seqlens, cache=cache, output_cache=True)
    if state is not None:
        state.update(ffn_state=ffn_state, layer_idx=self.layer_idx, offset=0)
    return self.value(act(self.key(x.addcmul(delta, self.x_k)))), state


OPS: dict[str, FlaOp] = {
    "chunk_rwkv7": FlaOp("fla.ops.rwkv7.chunk", torch_chunk_rwkv7, cuda_only=("cp_context",)),
    "fused_recurrent_rwkv7": FlaOp("fla.ops.rwkv7.fused_recurrent", torch_fused_recurrent_rwkv7),
    "fused_mul_recurrent_rwkv7": FlaOp("fla.ops.rwkv7.fused_recurrent", torch_fused_mul_recurrent_rwkv7),
    "fused_addcmul_rwkv7": FlaOp("fla.ops.rwkv7.fused_addcmul", torch_fused_addcmul_rwkv7),
    "fused_k_rwkv7": FlaOp("fla.ops.rwkv7.fused_k_update", torch_fused_k_rwkv7),
    "gate_output_correction": FlaOp("fla.ops.rwkv7.gate_output_correction", torch_gate_output_correction),
    "token_shift": FlaOp("fla.modules.token_shift", torch_token_shift),
    "l2_norm": FlaOp("fla.modules.l2norm", torch_l2norm),
}
MODULE_FORWARDS: dict[str, tuple[Callable, str]] = {
    "fla.modules:LayerNorm": (_layer_norm_forward_cpu, "x"),
    "fla.modules:GroupNorm": (_group_norm_forward_cpu, "x"),
    "fla.models.rwkv7.modeling_rwkv7:RWKV7FeedForward": (_rwkv7_ffn_forward_cpu, "x"),
}
