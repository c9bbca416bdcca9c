"""Torch versions of fla's DeltaNet, KDA, preconditioned Gated DeltaNet and preconditioned KDA ops (fla 0.6),
with fla's signatures and return conventions; the shared recurrence is in fla_cpu.delta_general.

OPS: fla op name -> FlaOp (merged into dispatch.OPS; a layer whose code looks the name up gets the
dispatcher bound in its place). MODULE_FORWARDS: "fla.module.path:Class" -> (torch forward, name of the
tensor argument that decides the device) (merged into the backend's module table); these layers need none.
DeltaNet's other helpers need nothing either: fla's `elu_p1` takes a torch path on CPU itself, `sum_norm` is torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ccq_eval.model.fla_cpu.common import (
    FlaOp,
    check_varlen,
    compute_dtype,
    from_k_first,
    run_varlen,
)
from ccq_eval.model.fla_cpu.delta_general import (
    beta_for_steps,
    check_gate_flags,
    delta_chunks,
    delta_steps,
    head_wise_beta_only,
    initial_state_k_first,
    kda_gate,
    preconditioned_keys,
    run_varlen_precond,
    state_layout,
)
from ccq_eval.model.fla_cpu.delta_rule import (
    gdn_inputs,
    torch_chunk_gated_delta_rule,
    torch_fused_recurrent_gated_delta_rule,
)

# --------------------------------------------------------------------------------------------
# DeltaNet
# --------------------------------------------------------------------------------------------


def torch_chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise delta rule (DeltaNet): the gated delta rule with zero log decay. q, k [B, T, H, K];
    v [B, T, H, V]; beta [B, T, H]; state [N, H, K, V]. Returns (o in q.dtype, final state)."""
    return torch_chunk_gated_delta_rule(
        q, k, v, None, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
    )


def torch_fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token delta rule; beta [B, T, H] or per channel [B, T, H, V] (None: ones).
    Returns (o in q.dtype, final state)."""
    o, state = torch_fused_recurrent_gated_delta_rule(
        q, k, v, beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
    )
    return o.to(q.dtype), state


# --------------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------------


def torch_fused_kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fla's fused_kda_gate (see `kda_gate`), g [..., H, K]. Returns output_dtype; float64 inputs stay float64."""
    dtype = compute_dtype(g, A_log, dt_bias)
    out = kda_gate(g, A_log, dt_bias, lower_bound, dtype)
    return out if dtype == torch.float64 else out.to(output_dtype)


def _kda_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                use_gate_in_kernel, A_log, dt_bias, lower_bound, dtype):
    """KDA's in-kernel preprocessing (as the gated delta rule's, with KDA's per-channel gate)."""
    if g.shape != (*v.shape[:3], k.shape[-1]):
        raise ValueError(f"KDA: g must be [B, T, HV, K] = {[*v.shape[:3], k.shape[-1]]}, got {list(g.shape)}")
    qs, ks, vs, gs, betas = gdn_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        False, None, None, dtype,
    )
    if use_gate_in_kernel:
        gs = kda_gate(gs, A_log, dt_bias, lower_bound, dtype)
    return qs, ks, vs, gs, betas


def torch_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA (delta rule with a per-channel decay). q, k [B, T, H, K]; v [B, T, HV, V];
    g [B, T, HV, K] (log decay, or the raw gate with use_gate_in_kernel: see `kda_gate`, A_log [HV],
    dt_bias [HV * K]); beta [B, T, HV]. Flags as fla's. Returns (o in q.dtype, final state [N, HV, K, V])."""
    if return_intermediate_states:
        raise NotImplementedError(
            "chunk_kda on CPU: return_intermediate_states (an inference-kernel output) is CUDA-only."
        )
    head_wise_beta_only("chunk_kda", beta, v)
    check_gate_flags(use_gate_in_kernel, safe_gate, lower_bound, A_log)
    state_v_first = state_layout(state_v_first, transpose_state_layout)
    check_varlen(q, cu_seqlens, initial_state)
    flags = {
        "scale": scale, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_gate_in_kernel": use_gate_in_kernel,
        "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel, "allow_neg_eigval": allow_neg_eigval,
        "lower_bound": lower_bound, "state_v_first": state_v_first, "A_log": A_log, "dt_bias": dt_bias,
    }
    if cu_seqlens is not None:
        return run_varlen(torch_chunk_kda, cu_seqlens, {"q": q, "k": k, "v": v, "g": g, "beta": beta},
                          initial_state, output_final_state, **flags)
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    qs, ks, vs, gs, betas = _kda_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        use_gate_in_kernel, A_log, dt_bias, lower_bound, dtype,
    )
    state = initial_state_k_first(initial_state, state_v_first, q, v, dtype)
    o, state = delta_chunks(qs, ks, ks, vs, gs, betas, state)
    return o.to(q.dtype), (from_k_first(state, state_v_first) if output_final_state else None)


def torch_fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (decay, correction, write, read); beta [B, T, HV] or per channel [B, T, HV, V].
    Returns (o in v.dtype, final state)."""
    check_gate_flags(use_gate_in_kernel, False, lower_bound, A_log)
    state_v_first = state_layout(state_v_first, transpose_state_layout)
    check_varlen(q, cu_seqlens, initial_state)
    flags = {
        "A_log": A_log, "dt_bias": dt_bias, "scale": scale, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
        "use_gate_in_kernel": use_gate_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
        "allow_neg_eigval": allow_neg_eigval, "lower_bound": lower_bound, "state_v_first": state_v_first,
    }
    if cu_seqlens is not None:
        return run_varlen(torch_fused_recurrent_kda, cu_seqlens, {"q": q, "k": k, "v": v, "g": g, "beta": beta},
                          initial_state, output_final_state, **flags)
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    qs, ks, vs, gs, betas = _kda_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        use_gate_in_kernel, A_log, dt_bias, lower_bound, dtype,
    )
    state = initial_state_k_first(initial_state, state_v_first, q, v, dtype)
    o, state = delta_steps(qs, ks, ks, vs, None, gs, None, beta_for_steps(betas), state)
    return o.to(v.dtype), (from_k_first(state, state_v_first) if output_final_state else None)


# --------------------------------------------------------------------------------------------
# preconditioned Gated DeltaNet
# --------------------------------------------------------------------------------------------


def torch_chunk_precond_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_atk: torch.Tensor,
    g: torch.Tensor,
    beta_atk: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Chunkwise preconditioned gated delta rule. q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]
    (log decay, post-sigmoid beta); g_atk, beta_atk [B, T, H] and log_atk_scale [H] drive the ATK statistic
    [N, H, K] (`preconditioned_keys`). Returns (o in q.dtype, state [N, HV, K, V] (V-first if
    transpose_state_layout), ATK statistic), the last two None unless output_final_state."""
    head_wise_beta_only("chunk_precond_gated_delta_rule", beta, v)
    check_varlen(q, cu_seqlens, initial_state)
    flags = {"scale": scale, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
             "transpose_state_layout": transpose_state_layout, "x": x, "eps": eps, "log_atk_scale": log_atk_scale}
    if cu_seqlens is not None:
        per_token = {"q": q, "k": k, "v": v, "g_atk": g_atk, "g": g, "beta_atk": beta_atk, "beta": beta}
        return run_varlen_precond(torch_chunk_precond_gated_delta_rule, cu_seqlens, per_token, initial_state,
                                   initial_A_state, output_final_state, **flags)
    dtype = compute_dtype(q, k, v, g_atk, g, beta_atk, beta, initial_state, initial_A_state)
    qs, ks, vs, gs, betas = gdn_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, False, False, False, None, None, dtype
    )
    written, stat = preconditioned_keys(ks, g_atk, beta_atk, initial_A_state, x, eps, log_atk_scale, dtype)
    state = initial_state_k_first(initial_state, transpose_state_layout, q, v, dtype)
    o, state = delta_chunks(qs, ks, written, vs, gs, betas, state)
    if not output_final_state:
        return o.to(q.dtype), None, None
    return o.to(q.dtype), from_k_first(state, transpose_state_layout), stat


def torch_fused_recurrent_precond_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    g_atk: torch.Tensor | None = None,
    beta_atk: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Token-by-token preconditioned gated delta rule: optional decays g [B, T, HV], gk [B, T, HV, K],
    gv [B, T, HV, V]; beta [B, T, HV] or [B, T, HV, V] (None: ones). Returns (o in v.dtype, state, ATK statistic)."""
    check_varlen(q, cu_seqlens, initial_state)
    flags = {"scale": scale, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
             "transpose_state_layout": transpose_state_layout, "x": x, "eps": eps, "log_atk_scale": log_atk_scale}
    if cu_seqlens is not None:
        per_token = {"q": q, "k": k, "v": v, "g": g, "gk": gk, "gv": gv, "beta": beta, "g_atk": g_atk,
                     "beta_atk": beta_atk}
        return run_varlen_precond(torch_fused_recurrent_precond_gated_delta_rule, cu_seqlens, per_token,
                                   initial_state, initial_A_state, output_final_state, **flags)
    dtype = compute_dtype(q, k, v, g, gk, gv, beta, g_atk, beta_atk, initial_state, initial_A_state)
    qs, ks, vs, gs, betas = gdn_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, False, False, False, None, None, dtype
    )
    written, stat = preconditioned_keys(ks, g_atk, beta_atk, initial_A_state, x, eps, log_atk_scale, dtype)
    state = initial_state_k_first(initial_state, transpose_state_layout, q, v, dtype)
    gk, gv = (None if t is None else t.to(dtype) for t in (gk, gv))
    o, state = delta_steps(qs, ks, written, vs, gs, gk, gv, beta_for_steps(betas), state)
    if not output_final_state:
        return o.to(v.dtype), None, None
    return o.to(v.dtype), from_k_first(state, transpose_state_layout), stat


# --------------------------------------------------------------------------------------------
# preconditioned KDA
# --------------------------------------------------------------------------------------------


def torch_chunk_precond_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    g_atk: torch.Tensor,
    beta_atk: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_gate_in_kernel: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | None = None,
    return_intermediate_states: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Chunkwise preconditioned KDA. q, k always l2-normalised (as fla's chunk_precond_kda does); g [B, T, HV, K]
    (log decay, or the raw gate with use_gate_in_kernel, see `kda_gate`); beta [B, T, HV] (post-sigmoid);
    g_atk, beta_atk with as many heads as the ATK statistic. Returns (o in q.dtype, state, ATK statistic)."""
    if return_intermediate_states:
        raise NotImplementedError(
            "chunk_precond_kda on CPU: return_intermediate_states (an inference-kernel output) is CUDA-only."
        )
    head_wise_beta_only("chunk_precond_kda", beta, v)
    check_gate_flags(use_gate_in_kernel, safe_gate, lower_bound, A_log)
    check_varlen(q, cu_seqlens, initial_state)
    flags = {"scale": scale, "use_gate_in_kernel": use_gate_in_kernel, "lower_bound": lower_bound,
             "transpose_state_layout": transpose_state_layout, "x": x, "eps": eps, "log_atk_scale": log_atk_scale,
             "A_log": A_log, "dt_bias": dt_bias}
    if cu_seqlens is not None:
        per_token = {"q": q, "k": k, "v": v, "g": g, "g_atk": g_atk, "beta_atk": beta_atk, "beta": beta}
        return run_varlen_precond(torch_chunk_precond_kda, cu_seqlens, per_token, initial_state, initial_A_state,
                                   output_final_state, **flags)
    dtype = compute_dtype(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state)
    qs, ks, vs, gs, betas = _kda_inputs(
        q, k, v, g, beta, scale, True, False, False, use_gate_in_kernel, A_log, dt_bias, lower_bound, dtype
    )
    written, stat = preconditioned_keys(ks, g_atk, beta_atk, initial_A_state, x, eps, log_atk_scale, dtype)
    state = initial_state_k_first(initial_state, transpose_state_layout, q, v, dtype)
    o, state = delta_chunks(qs, ks, written, vs, gs, betas, state)
    if not output_final_state:
        return o.to(q.dtype), None, None
    return o.to(q.dtype), from_k_first(state, transpose_state_layout), stat


def torch_fused_recurrent_precond_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    g_atk: torch.Tensor,
    beta_atk: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Token-by-token preconditioned KDA; beta [B, T, HV] or [B, T, HV, V]. Returns (o in v.dtype, state,
    ATK statistic)."""
    if use_gate_in_kernel and A_log is None:
        raise ValueError("fused_recurrent_precond_kda: use_gate_in_kernel=True needs A_log.")
    check_varlen(q, cu_seqlens, initial_state)
    flags = {"A_log": A_log, "dt_bias": dt_bias, "scale": scale, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
             "use_gate_in_kernel": use_gate_in_kernel, "lower_bound": lower_bound,
             "transpose_state_layout": transpose_state_layout, "x": x, "eps": eps, "log_atk_scale": log_atk_scale}
    if cu_seqlens is not None:
        per_token = {"q": q, "k": k, "v": v, "g": g, "g_atk": g_atk, "beta_atk": beta_atk, "beta": beta}
        return run_varlen_precond(torch_fused_recurrent_precond_kda, cu_seqlens, per_token, initial_state,
                                   initial_A_state, output_final_state, **flags)
    dtype = compute_dtype(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state)
    qs, ks, vs, gs, betas = _kda_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, False, False, use_gate_in_kernel, A_log, dt_bias,
        lower_bound, dtype,
    )
    written, stat = preconditioned_keys(ks, g_atk, beta_atk, initial_A_state, x, eps, log_atk_scale, dtype)
    state = initial_state_k_first(initial_state, transpose_state_layout, q, v, dtype)
    o, state = delta_steps(qs, ks, written, vs, None, gs, None, beta_for_steps(betas), state)
    if not output_final_state:
        return o.to(v.dtype), None, None
    return o.to(v.dtype), from_k_first(state, transpose_state_layout), stat


OPS: dict[str, FlaOp] = {
    "chunk_delta_rule": FlaOp("fla.ops.delta_rule.chunk", torch_chunk_delta_rule),
    "fused_recurrent_delta_rule": FlaOp("fla.ops.delta_rule.fused_recurrent", torch_fused_recurrent_delta_rule),
    "chunk_kda": FlaOp("fla.ops.kda.chunk", torch_chunk_kda,
                       from_kwargs=("A_log", "dt_bias", "transpose_state_layout"), cuda_only=("cp_context",)),
    "fused_recurrent_kda": FlaOp("fla.ops.kda.fused_recurrent", torch_fused_recurrent_kda,
                                 from_kwargs=("transpose_state_layout",)),
    "fused_kda_gate": FlaOp("fla.ops.kda.gate", torch_fused_kda_gate),
    "chunk_precond_gated_delta_rule": FlaOp("fla.ops.precond_gated_delta_rule.chunk",
                                            torch_chunk_precond_gated_delta_rule, cuda_only=("cp_context",)),
    "fused_recurrent_precond_gated_delta_rule": FlaOp("fla.ops.precond_gated_delta_rule.fused_recurrent",
                                                      torch_fused_recurrent_precond_gated_delta_rule),
    "chunk_precond_kda": FlaOp("fla.ops.precond_kda.chunk", torch_chunk_precond_kda,
                               from_kwargs=("A_log", "dt_bias"), cuda_only=("cp_context",)),
    "fused_recurrent_precond_kda": FlaOp("fla.ops.precond_kda.fused_recurrent", torch_fused_recurrent_precond_kda),
}
MODULE_FORWARDS: dict[str, tuple[Callable, str]] = {}
