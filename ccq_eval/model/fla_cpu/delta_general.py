"""The generalised delta rule behind fla_cpu.delta_variants (DeltaNet, KDA, PGDN, PrecondKDA), in torch.

One recurrence with a K-first state S [K, V]:
    S <- decay_t S;  delta_t = beta_t (v_t - S^T k_t);  S <- S + w_t delta_t^T;  o_t = S^T q_t
where decay_t is exp(g_t) (a scalar per head) or diag(exp(g_t)) over K, and the written key w_t is k_t, or
for the preconditioned rules k_t * M_t with M_t a squash of the diagonal "ATK" statistic
A_t = exp(g_atk_t) A_{t-1} + beta_atk_t k_t^2 (a linear scan, computed chunkwise before the delta rule).
The chunked form solves each chunk's corrections with one unit lower triangular system (UT / WY transform);
per-channel decays between two positions are evaluated exactly within a sub-block and through the
sub-block boundary further apart, so every exponent is <= 0. Algorithms after the DeltaNet, Gated DeltaNet,
Kimi Linear and Preconditioned DeltaNet papers; the code is ours.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ccq_eval.model.fla_cpu.common import (
    GLA_SUB_BLOCK,
    causal_mask,
    chunk_size_for,
    maybe_checkpoint,
    pad_time,
    relative_decay,
    segment_ranges,
    to_k_first,
)

# fla's centre of the ATK squash (log space) when no log_atk_scale is given.
DEFAULT_LOG_ATK_SCALE = -0.2


# --------------------------------------------------------------------------------------------
# the generalised delta rule: chunkwise and token by token
# --------------------------------------------------------------------------------------------


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """sum_j a[t, j] b[s, j] exp(cum[t, j] - cum[s, j]) for s <= t, 0 above the diagonal.

    a [..., C, K], b and cum broadcastable to it -> [..., C, C]. Within a sub-block the decay is taken
    elementwise; an earlier sub-block factorises through the position before the current one, both
    factors having exponents <= 0 (cum is non-increasing), so nothing overflows however strong the decay.
    """
    C = a.shape[-2]
    sub = min(GLA_SUB_BLOCK, C)
    scores = a.new_zeros(*torch.broadcast_shapes(a.shape, b.shape)[:-1], C)
    for start in range(0, C, sub):
        rows = slice(start, min(start + sub, C))
        cum_b = cum[..., rows, :]
        diff = cum_b[..., :, None, :] - cum_b[..., None, :, :]
        mask = causal_mask(cum_b.shape[-2], cum.device)[..., None]
        decay = diff.masked_fill(~mask, float("-inf")).exp()
        scores[..., rows, rows] = (a[..., rows, None, :] * b[..., None, rows, :] * decay).sum(-1)
        if start > 0:
            ref = cum[..., start - 1 : start, :]
            a_ref = a[..., rows, :] * (cum[..., rows, :] - ref).exp()
            b_ref = b[..., :start, :] * (ref - cum[..., :start, :]).exp()
            scores[..., rows, :start] = a_ref @ b_ref.transpose(-1, -2)
    return scores


def _delta_segment(q, k, w, v, g, beta, state):
    """One segment of the chunkwise delta rule. q (normalised, scaled), k (read key), w (written key):
    [B, H, N, C, K]; v [B, H, N, C, V]; g: log decays, [B, H, N, C] (scalar) or [B, H, N, C, K] (over K);
    beta [B, H, N, C]; state [B, H, K, V] (K-first). Returns o [B, H, N, C, V] and the state after it."""
    if g.dim() == q.dim():
        cum = g.cumsum(-2)
        # q and k rows against w columns with per-channel relative decays, s <= t
        q_scores, k_scores = _decayed_scores(torch.stack([q, k]), w, cum).unbind(0)
        growth = cum.exp()  # decay from the chunk start, per channel
        last = cum[..., -1:, :]
        w_tail = w * (last - cum).exp()
        chunk_decay = last.transpose(-1, -2).exp()  # [B, H, N, K, 1]
    else:
        cum = g.cumsum(-1)
        decay = relative_decay(cum)
        q_scores, k_scores = ((x @ w.transpose(-1, -2)) * decay for x in (q, k))
        growth = cum.exp()[..., None]
        w_tail = w * (cum[..., -1:] - cum).exp()[..., None]
        chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    # The corrections d_t = beta_t (v_t - S_t'^T k_t) of a chunk solve (I + L) D = beta V - beta (k * growth) S_0,
    # L[t, s] = beta_t k_scores[t, s] for s < t; only the strict lower triangle of `lower` is read.
    lower = beta[..., :, None] * k_scores
    rhs = torch.cat([v * beta[..., None], k * growth * beta[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u, wy = solved.split([v.shape[-1], k.shape[-1]], dim=-1)  # D = u - wy S_0
    q_start = q * growth
    outputs = []
    for n in range(q.shape[2]):
        delta = u[:, :, n] - wy[:, :, n] @ state
        outputs.append(q_start[:, :, n] @ state + q_scores[:, :, n] @ delta)
        state = chunk_decay[:, :, n] * state + w_tail[:, :, n].transpose(-1, -2) @ delta
    return torch.stack(outputs, dim=2), state


def delta_chunks(q, k, w, v, g, beta, state):
    """The chunkwise delta rule over a whole sequence. Time-first inputs in the compute dtype: q, k, w
    [B, T, H, K]; v [B, T, H, V]; g [B, T, H] or [B, T, H, K]; beta [B, T, H]; state [B, H, K, V] (K-first).
    Pads to whole chunks (zero keys, betas and decays leave the state alone) and runs segment by segment.
    Returns o [B, T, H, V] and the final state."""
    B, T, H, V = v.shape
    if T == 0:
        return v.new_zeros(B, 0, H, V), state
    C = chunk_size_for(T)
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    q, k, w, v, g, beta = (pad_time(x.transpose(1, 2), pad) for x in (q, k, w, v, g, beta))
    q, k, w, v = (x.reshape(B, H, num_chunks, C, x.shape[-1]) for x in (q, k, w, v))
    g = g.reshape(B, H, num_chunks, C, *g.shape[3:])
    beta = beta.reshape(B, H, num_chunks, C)
    outputs = []
    for a, b in segment_ranges(num_chunks, C):
        o_seg, state = maybe_checkpoint(
            _delta_segment, q[:, :, a:b], k[:, :, a:b], w[:, :, a:b], v[:, :, a:b], g[:, :, a:b], beta[:, :, a:b],
            state,
        )
        outputs.append(o_seg)
    o = torch.cat(outputs, dim=2).reshape(B, H, num_chunks * C, V)[:, :, :T].transpose(1, 2)
    return o, state


def delta_steps(q, k, w, v, g, gk, gv, beta, state):
    """The delta rule token by token: decays (g scalar [B, T, H], gk over K, gv over V, each optional), the
    correction with beta [B, T, H, 1 or V], the write with w, the read with q. Time-first inputs as in
    `delta_chunks`; returns o [B, T, H, V] and the final state."""
    B, T, H, V = v.shape
    outputs = []
    for t in range(T):
        if g is not None:
            state = state * g[:, t].exp()[..., None, None]
        if gk is not None:
            state = state * gk[:, t].exp()[..., :, None]
        if gv is not None:
            state = state * gv[:, t].exp()[..., None, :]
        delta = beta[:, t] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + w[:, t, :, :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outputs, dim=1) if T > 0 else v.new_zeros(B, 0, H, V)
    return o, state


# --------------------------------------------------------------------------------------------
# gates, the ATK preconditioner, state layouts, varlen
# --------------------------------------------------------------------------------------------


def kda_gate(g, A_log, dt_bias, lower_bound, dtype):
    """KDA's log decay from the raw gate g [..., H, K] in `dtype`: -exp(A_log) * softplus(g + dt_bias), or with
    lower_bound set lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (without A_log: sigmoid(g + dt_bias)).
    A_log [H], dt_bias [H * K]."""
    H, K = g.shape[-2:]
    g = g.to(dtype)
    if dt_bias is not None:
        g = g + dt_bias.to(dtype).reshape(H, K)
    rate = None if A_log is None else A_log.to(dtype).reshape(H, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(g if rate is None else rate * g)
    if rate is None:
        raise ValueError("KDA gate: A_log is required unless lower_bound is set.")
    return -rate * F.softplus(g)


def check_gate_flags(use_gate_in_kernel, safe_gate, lower_bound, A_log):
    """The checks fla's KDA ops make on their gate arguments, as ValueErrors."""
    if not use_gate_in_kernel:
        return
    if A_log is None and lower_bound is None:
        raise ValueError("use_gate_in_kernel=True needs A_log (or lower_bound for the A_log-free gate).")
    if safe_gate:
        if lower_bound is None:
            raise ValueError("safe_gate=True with use_gate_in_kernel=True needs lower_bound.")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must be in the safe range [-5, 0), got {lower_bound}.")


def _atk_statistic(k, g_atk, beta_atk, A0):
    """A_t = exp(g_atk_t) A_{t-1} + beta_atk_t k_t^2 for every t, chunkwise (a scalar-decay linear scan).
    k [B, T, H, K], g_atk and beta_atk [B, T, H], A0 [B, H, K]. Returns A [B, T, H, K] and A_T."""
    B, T, H, K = k.shape
    if T == 0:
        return k.new_zeros(B, 0, H, K), A0
    C = chunk_size_for(T)
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    update = pad_time(beta_atk[..., None] * k.square(), pad, dim=1).transpose(1, 2).reshape(B, H, num_chunks, C, K)
    cum = pad_time(g_atk, pad, dim=1).transpose(1, 2).reshape(B, H, num_chunks, C).cumsum(-1)
    within = relative_decay(cum) @ update  # contributions from the chunk's own tokens
    growth = cum.exp()[..., None]
    starts = []
    state = A0
    for n in range(num_chunks):
        starts.append(state)
        state = growth[:, :, n, -1] * state + within[:, :, n, -1]
    stats = growth * torch.stack(starts, dim=2)[..., None, :] + within
    return stats.reshape(B, H, num_chunks * C, K)[:, :, :T].transpose(1, 2), state


def preconditioned_keys(k, g_atk, beta_atk, initial_A_state, x, eps, log_atk_scale, dtype):
    """The written keys of the preconditioned delta rules and the final ATK statistic.

    k [B, T, HV, K]: the (normalised) keys, one per value head. The statistic has as many heads as g_atk
    (the key heads H, shared by each group of HV // H value heads, or all HV heads). M = exp(-log(x) * s),
    s = r / (1 + |r|), r = log(A + eps) - log_atk_scale (fla's symmetric fast squash, M in [1/x, x]).
    Returns k * M [B, T, HV, K] and A_T [B, H_atk, K], both in `dtype`.
    """
    if g_atk is None or beta_atk is None:
        raise ValueError("the preconditioned delta rule needs g_atk and beta_atk.")
    B, _, HV, K = k.shape
    heads = g_atk.shape[2]
    if HV % heads != 0:
        raise ValueError(f"g_atk has {heads} heads; the {HV} value heads must be a multiple of it.")
    group = HV // heads
    k_atk = k[:, :, ::group]  # k repeats each key head `group` times; this takes each once
    A0 = k.new_zeros(B, heads, K) if initial_A_state is None else initial_A_state.to(dtype)
    stats, final = _atk_statistic(k_atk, g_atk.to(dtype), beta_atk.to(dtype), A0)
    if log_atk_scale is None:
        log_atk_scale = DEFAULT_LOG_ATK_SCALE
    center = log_atk_scale.to(dtype)[:, None] if isinstance(log_atk_scale, torch.Tensor) else log_atk_scale
    r = torch.log(stats + eps) - center
    log_x = math.log(x) if x > 0 else 0.0
    multiplier = torch.exp(-log_x * (r / (1.0 + r.abs())))
    written = k_atk * multiplier
    if group > 1:
        written = written.repeat_interleave(group, dim=2)
    return written, final


def initial_state_k_first(initial_state, v_first, q, v, dtype):
    """The initial state K-first [N, HV, K, V] in `dtype` (zeros when None)."""
    B, _, HV, V = v.shape
    state = to_k_first(initial_state, v_first, dtype)
    return q.new_zeros(B, HV, q.shape[-1], V, dtype=dtype) if state is None else state


def beta_for_steps(beta):
    """beta [B, T, H] (one per head) or [B, T, H, V] (per value channel) as [B, T, H, 1 or V]."""
    return beta[..., None] if beta.dim() == 3 else beta


def head_wise_beta_only(name, beta, v):
    """The chunked forms take one beta per head and step, as fla's chunk kernels do."""
    if beta is not None and beta.dim() == v.dim():
        raise NotImplementedError(
            f"{name} supports a head-wise beta [B, T, HV] only; its fused_recurrent form takes a per-channel beta."
        )


def run_varlen_precond(fn, cu_seqlens, per_token, initial_state, initial_A_state, output_final_state, **kwargs):
    """`fn` (a preconditioned op, returning o, S, A) on each packed sequence of a [1, total, ...] batch."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    outputs, states, stats = [], [], []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        sliced = {name: (t[:, start:end] if t is not None else None) for name, t in per_token.items()}
        o, ht, at = fn(
            **sliced,
            initial_state=None if initial_state is None else initial_state[i : i + 1],
            initial_A_state=None if initial_A_state is None else initial_A_state[i : i + 1],
            output_final_state=output_final_state,
            cu_seqlens=None,
            **kwargs,
        )
        outputs.append(o)
        states.append(ht)
        stats.append(at)
    o = torch.cat(outputs, dim=1)
    if not output_final_state:
        return o, None, None
    return o, torch.cat(states, dim=0), torch.cat(stats, dim=0)


def state_layout(state_v_first, transpose_state_layout):
    """fla's KDA ops still take the deprecated name `transpose_state_layout` for state_v_first."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    return bool(transpose_state_layout)
