"""The gated delta rule in torch (chunkwise via the UT / WY transform, and recurrent), with fla's signatures.

S_t = exp(g_t) S_{t-1}; S_t += beta_t k_t (v_t - S_t^T k_t)^T; o_t = S_t^T q_t. Within a chunk the
corrections solve a unit lower triangular system (I + N) X = [beta v, beta gamma k].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ccq_eval.model.fla_cpu.common import (
    CHUNK_SIZE,
    causal_mask,
    check_varlen,
    compute_dtype,
    from_k_first,
    maybe_checkpoint,
    pad_time,
    relative_decay,
    run_varlen,
    segment_ranges,
    to_k_first,
)


def torch_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis (fla's l2norm; eps inside the root)."""
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y.to(x.dtype if output_dtype is None else output_dtype)


def gdn_inputs(
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
    decay = relative_decay(cum)  # exp(cum_t - cum_s), s <= t
    strict = causal_mask(cum.shape[-1], cum.device, strict=True)
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


def _gdn_chunks(qs, ks, vs, gs, betas, state):
    """The chunkwise gated delta rule over a whole sequence of T >= 1 steps, after `gdn_inputs`: qs, ks
    [B, T, HV, K]; vs [B, T, HV, V]; gs, betas [B, T, HV]; state [B, HV, K, V] (K-first). Pads to whole
    chunks and runs them segment by segment (`_gdn_segment`, checkpointed where `maybe_checkpoint`
    says). Returns o [B, T, HV, V] in the compute dtype and the final state."""
    B, T, HV, V = vs.shape
    # heads first, pad to whole chunks (zero key, beta and log decay leave the state untouched)
    qs, ks, vs, gs, betas = (x.transpose(1, 2) for x in (qs, ks, vs, gs, betas))
    C = CHUNK_SIZE
    num_chunks = -(-T // C)
    pad = num_chunks * C - T
    qs, ks, vs, gs, betas = (pad_time(x, pad) for x in (qs, ks, vs, gs, betas))
    qs, ks, vs = (x.reshape(B, HV, num_chunks, C, x.shape[-1]) for x in (qs, ks, vs))
    gs, betas = (x.reshape(B, HV, num_chunks, C) for x in (gs, betas))
    outputs = []
    for a, b in segment_ranges(num_chunks, C):
        o_seg, state = maybe_checkpoint(
            _gdn_segment, qs[:, :, a:b], ks[:, :, a:b], vs[:, :, a:b], gs[:, :, a:b], betas[:, :, a:b], state
        )
        outputs.append(o_seg)
    o = torch.cat(outputs, dim=2).reshape(B, HV, num_chunks * C, V)[:, :, :T].transpose(1, 2)
    return o, state


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
    check_varlen(q, cu_seqlens, initial_state)
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
        return run_varlen(
            torch_chunk_gated_delta_rule,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "g": g, "beta": beta},
            initial_state,
            output_final_state,
            **flags,
        )
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    qs, ks, vs, gs, betas = gdn_inputs(
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
    state = to_k_first(initial_state, state_v_first, dtype)
    if state is None:
        state = vs.new_zeros(B, HV, K, V)
    if T == 0:
        o = v.new_zeros(B, 0, HV, V, dtype=q.dtype)
        return o, (from_k_first(state, state_v_first) if output_final_state else None)
    o, state = _gdn_chunks(qs, ks, vs, gs, betas, state)
    return o.to(q.dtype), (from_k_first(state, state_v_first) if output_final_state else None)


def _gdn_steps(qs, ks, vs, gs, gk, gv, betas, state):
    """The gated delta rule token by token, after `gdn_inputs`: per step the decays (g head-wise, gk
    over K, gv over V, each optional), then the delta update with beta [B, T, HV, 1 or V], then the
    read. qs, ks [B, T, HV, K]; vs [B, T, HV, V]; state [B, HV, K, V] (K-first). Returns o [B, T, HV, V]
    and the final state."""
    B, T, HV, V = vs.shape
    outputs = []
    for t in range(T):
        if gs is not None:
            state = state * gs[:, t].exp()[..., None, None]
        if gk is not None:
            state = state * gk[:, t].exp()[..., :, None]
        if gv is not None:
            state = state * gv[:, t].exp()[..., None, :]
        k_t = ks[:, t]
        delta = betas[:, t] * (vs[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", qs[:, t], state))
    o = torch.stack(outputs, dim=1) if T > 0 else vs.new_zeros(B, 0, HV, V)
    return o, state


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
    check_varlen(q, cu_seqlens, initial_state)
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
        return run_varlen(
            torch_fused_recurrent_gated_delta_rule,
            cu_seqlens,
            {"q": q, "k": k, "v": v, "g": g, "gk": gk, "gv": gv, "beta": beta},
            initial_state,
            output_final_state,
            **flags,
        )
    dtype = compute_dtype(q, k, v, g, gk, gv, beta, initial_state)
    qs, ks, vs, gs, betas = gdn_inputs(
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
    B, _, HV, V = v.shape
    K = k.shape[-1]
    if betas.dim() == 3:
        betas = betas[..., None]
    state = to_k_first(initial_state, state_v_first, dtype)
    if state is None:
        state = vs.new_zeros(B, HV, K, V)
    gk, gv = (None if x is None else x.to(dtype) for x in (gk, gv))
    o, state = _gdn_steps(qs, ks, vs, gs, gk, gv, betas, state)
    return o.to(v.dtype), (from_k_first(state, state_v_first) if output_final_state else None)
