"""One-token decode step of the CCQ recurrence as a single Triton launch (state update and q~)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ccq_eval.model.kernels.triton_device import launches_on_input_device


@triton.jit
def _ccq_decode_kernel(
    r, k, log_gamma, gate_weight, gate_bias, lam_max, P, m, n, P_out, m_out, n_out, q_out,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, CENTERED: tl.constexpr, QUERY_GATE: tl.constexpr,
):
    """One decoding step for one (batch, head) and BK rows of the K x K state: P <- gamma P + kappa
    kappa^T, m <- gamma m + kappa, n <- gamma n + 1 (written to new buffers, the cache's stay as they
    are), then q~ = r - lambda Sigma r with the updated sums, as ccq.ccq_read_recurrent. The key is
    normalised and lambda formed here, from the gate's parameters in their own dtype (QUERY_GATE=False:
    the constant gate, gate_weight never read)."""
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    every = tl.arange(0, K)
    rows = i_r * BK + tl.arange(0, BK)
    r_all = tl.load(r + i_bh * K + every).to(tl.float32)
    k_all = tl.load(k + i_bh * K + every).to(tl.float32)
    inv_norm = 1.0 / tl.maximum(tl.sqrt(tl.sum(k_all * k_all, 0)), 1e-6)
    kap_all = k_all * inv_norm
    kap_rows = tl.load(k + i_bh * K + rows).to(tl.float32) * inv_norm
    gamma = tl.exp(tl.load(log_gamma + i_bh).to(tl.float32))
    gate_logit = tl.load(gate_bias + i_h).to(tl.float32)
    if QUERY_GATE:
        gate_logit += tl.sum(r_all * tl.load(gate_weight + i_h * K + every).to(tl.float32), 0)
    lam = lam_max * tl.sigmoid(gate_logit)

    P_rows = gamma * tl.load(P + i_bh * K * K + rows[:, None] * K + every[None, :]) \
        + kap_rows[:, None] * kap_all[None, :]
    tl.store(P_out + i_bh * K * K + rows[:, None] * K + every[None, :], P_rows)
    m_rows = gamma * tl.load(m + i_bh * K + rows) + kap_rows
    tl.store(m_out + i_bh * K + rows, m_rows)
    n_new = gamma * tl.load(n + i_bh) + 1.0
    if i_r == 0:
        tl.store(n_out + i_bh, n_new)
    sigma_r = tl.sum(P_rows * r_all[None, :], 1) / n_new
    if CENTERED:
        m_all = gamma * tl.load(m + i_bh * K + every) + kap_all
        sigma_r -= m_rows / n_new * (tl.sum(m_all * r_all, 0) / n_new)
    r_rows = tl.load(r + i_bh * K + rows).to(tl.float32)
    tl.store(q_out + i_bh * K + rows, (r_rows - lam * sigma_r).to(q_out.dtype.element_ty))


DECODE_ROWS = 16


@launches_on_input_device
def ccq_order1_decode(r, k, log_gamma, gate, state, centered: bool = True):
    """One token, r and raw keys k [B, 1, H, K], log_gamma [B, 1, H], gate (a [H, K] or None, b [H], lam_max),
    state (P, m, n) fp32: returns q~ [B, 1, H, K] and the new state (new tensors). K a power of two."""
    B, T, H, K = r.shape
    if T != 1 or K & (K - 1):
        raise ValueError(f"ccq_order1_decode: one token and a power-of-two head dim, got T={T}, K={K}")
    P, m, n = (x.float().contiguous() for x in state)
    # The gate's parameters as they are (bf16 in a bf16 model), converted in the kernel: a decoded
    # token otherwise spends two conversion launches per layer on them, and each launch of a one-token
    # step costs about as much as its work (benchmarks/profile_forward.py --mode generate).
    weight, bias, lam_max = gate
    bias = bias.contiguous()
    P_out, m_out, n_out = torch.empty_like(P), torch.empty_like(m), torch.empty_like(n)
    q = torch.empty_like(r)
    _ccq_decode_kernel[(K // DECODE_ROWS, B * H)](
        r.contiguous(), k.contiguous(), log_gamma.float().contiguous(),
        bias if weight is None else weight.contiguous(), bias, float(lam_max),
        P, m, n, P_out, m_out, n_out, q,
        H=H, K=K, BK=DECODE_ROWS, CENTERED=bool(centered), QUERY_GATE=weight is not None, num_warps=4,
    )
    return q, (P_out, m_out, n_out)
