"""Backward of the fused Triton CCQ read of order 1 (see ccq_forward for the forward and its states).

Kernels run on CUDA; with TRITON_INTERPRET=1 (set before this module is imported) they run on CPU
tensors, which is how the CPU tests check them against autograd through `ccq.ccq_read_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ccq_eval.model.kernels.ccq_chunk_states import CHUNK, autotuned, chunk_rows, in_chunk_decays, scan_states
from ccq_eval.model.kernels.ccq_forward import kernel_gate
from ccq_eval.model.kernels.triton_device import launches_on_input_device

# ------------------------------------------------------------------------------------------ backward
# Gradients of q~ = r - lam * s, s = Pu / n - mu (mu . r) (centered), Pu_t = sum_{i<=t} w_{i,t}
# kappa_i (kappa_i . r_t), for a call from a zero state (training). With ds = -lam dq:
#   dlam = -(dq . s);  dPu = ds / n;  centered: dalpha = -(mu . ds), dmu = -alpha ds + dalpha r,
#   dm = dmu / n;  dn = -(ds . Pu) / n^2 - (dmu . m) / n^2
#   dr = dq + dalpha mu + P_t dPu_t                                   (causal, like the forward)
#   dkappa_i = sum_{t>=i} w_{i,t} [(kappa_i . r_t) dPu_t + (kappa_i . dPu_t) r_t + dm_t]  (anti-causal)
#   d c_t = X_t - Y_t, X_t = dPu_t . Pu_t + m_t . dm_t + n_t dn_t,
#   Y_i = sum_{t>=i} w_{i,t} [(kappa_i . r_t)(kappa_i . dPu_t) + kappa_i . dm_t + dn_t]
#   X_t = 0: it is the derivative along a common scale of (Pu_t, m_t, n_t), and s_t is invariant to
#   one (substitute dn above), so d c_t = -Y_t and the kernels never form X.
#   d log_gamma_j = sum_{t>=j} d c_t                                  (c_t: cumulative log decay)
# (derived by hand; tests check all four gradients against autograd through ccq_read_reference).

# BK: the width of a column block, and of the reduction tile of the products with a K x K state
# (8 warps). 16 and 32 only: with 64 the query kernel spills registers, and tiles of other shapes
# failed in bf16 on a GPU (benchmarks/README.md).
_BWD_CONFIGS = [triton.Config({"BK": bk}, num_warps=8, num_stages=2) for bk in (16, 32)]
# The local sums' tiles: few candidates on purpose, each compiles on the first call of a shape.
_LOCAL_CONFIGS = [triton.Config({"BK": bk, "BV": bk}, num_warps=warps, num_stages=2)
                  for bk in (32, 64) for warps in (4, 8)]


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """a @ b: exact fp32 products for fp32 inputs, else bf16 tensor-core products (fp32 accumulate)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _rows_times_state(x, base, row_ok, state, js, C: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      IEEE: tl.constexpr):
    """x[t, :] @ state[:, js] for the C rows of x at `base` and a K x K state (pointer at its start):
    [C, BK] fp32, the K reduction in BK-wide tiles. The backward's head-dim loops are runtime loops:
    unrolled, ptxas (triton 3.6) took about 2 minutes for the fp32 query kernel at K = 128."""
    out = tl.zeros([C, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x_k = tl.load(x + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        out += _mm(x_k, tl.load(state + ks[:, None] * K + js[None, :]), IEEE)
    return out


@triton.jit
def _unit_rows(kappa, base, row_ok, js, inv_norm, NORMALIZE: tl.constexpr):
    """kappa[t, js] for the chunk's rows, fp32; raw keys (NORMALIZE) scaled to unit length."""
    x = tl.load(kappa + base[:, None] + js[None, :], mask=row_ok, other=0.0).to(tl.float32)
    if NORMALIZE:
        x = x * inv_norm[:, None]
    return x


@triton.jit
def _query_pass_sums(r, kappa, m_in, P_in, dq, base, row_ok, state, inv_norm, from_start, A, D, n, alpha,
                     lam_t, C: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, CENTERED: tl.constexpr,
                     NORMALIZE: tl.constexpr, IEEE: tl.constexpr):
    """Pass 1 of _ccq_bwd_query_kernel: per position t of the chunk, dlam_t = -(dq_t . s_t), ds_t . m_t
    and ds_t . Pu_t (ds = -lam dq), with Pu, m and s recomputed as in the forward, BK columns at a time."""
    dlam = tl.zeros([C], dtype=tl.float32)
    ds_dot_m = tl.zeros([C], dtype=tl.float32)
    ds_dot_Pu = tl.zeros([C], dtype=tl.float32)
    for j0 in range(0, K, BK):
        js = j0 + tl.arange(0, BK)
        carried = _rows_times_state(r, base, row_ok, P_in + state * K * K, js, C, K, BK, IEEE)
        kap_j = _unit_rows(kappa, base, row_ok, js, inv_norm, NORMALIZE)
        Pu = from_start[:, None] * carried + _mm(A, kap_j, IEEE)
        m = from_start[:, None] * tl.load(m_in + state * K + js)[None, :] + _mm(D, kap_j, IEEE)
        s = Pu / n[:, None]
        if CENTERED:
            s -= (m / n[:, None]) * alpha[:, None]
        dq_j = tl.load(dq + base[:, None] + js[None, :], mask=row_ok, other=0.0).to(tl.float32)
        ds = -lam_t[:, None] * dq_j
        dlam -= tl.sum(dq_j * s, 1)
        ds_dot_m += tl.sum(ds * m, 1)
        ds_dot_Pu += tl.sum(ds * Pu, 1)
    return dlam, ds_dot_m, ds_dot_Pu


@triton.jit
def _query_pass_dPu(r, kappa, dq, dPu_out, dm_out, base, row_ok, inv_norm, n, alpha, dalpha, lam_t,
                    C: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, CENTERED: tl.constexpr,
                    NORMALIZE: tl.constexpr, IEEE: tl.constexpr):
    """Pass 2 of _ccq_bwd_query_kernel: dPu_t = ds_t / n_t and (CENTERED) dm_t = (-alpha_t ds_t + dalpha_t
    r_t) / n_t written to memory for the key gradients, BK columns at a time; returns E = dPu kappa^T,
    [C, C] fp32."""
    E = tl.zeros([C, C], dtype=tl.float32)
    for j0 in range(0, K, BK):
        js = j0 + tl.arange(0, BK)
        kap_j = _unit_rows(kappa, base, row_ok, js, inv_norm, NORMALIZE)
        dq_j = tl.load(dq + base[:, None] + js[None, :], mask=row_ok, other=0.0).to(tl.float32)
        dPu = -lam_t[:, None] * dq_j / n[:, None]
        E += _mm(dPu, tl.trans(kap_j), IEEE)
        tl.store(dPu_out + base[:, None] + js[None, :], dPu.to(dPu_out.dtype.element_ty), mask=row_ok)
        if CENTERED:
            r_j = tl.load(r + base[:, None] + js[None, :], mask=row_ok, other=0.0).to(tl.float32)
            dm = -alpha[:, None] * dPu + dalpha[:, None] * r_j / n[:, None]
            tl.store(dm_out + base[:, None] + js[None, :], dm.to(dm_out.dtype.element_ty), mask=row_ok)
    return E


@triton.jit
def _query_pass_dr(r, kappa, m_in, P_in, dq, dr, dPu, gate_weight, dweight_out, base, row_ok, state, inv_norm,
                   from_start, ED, D, n, dalpha, dlam, c, i_bh, i_h, C: tl.constexpr, K: tl.constexpr,
                   BK: tl.constexpr, CENTERED: tl.constexpr, NORMALIZE: tl.constexpr, GATE: tl.constexpr,
                   IEEE: tl.constexpr):
    """Pass 3 of _ccq_bwd_query_kernel: dr_t = dq_t + dalpha_t mu_t + P_t dPu_t, P_t dPu_t being the
    carried part exp(b_t) P_in[c] dPu_t plus the in-chunk part (ED = E * D) @ kappa, BK columns at a
    time. GATE: dr_t also gets d logit_t a_h (dlam holds d logit), and dweight_out this chunk's
    sum_t d logit_t r_t."""
    for j0 in range(0, K, BK):
        js = j0 + tl.arange(0, BK)
        carried = _rows_times_state(dPu, base, row_ok, P_in + state * K * K, js, C, K, BK, IEEE)
        kap_j = _unit_rows(kappa, base, row_ok, js, inv_norm, NORMALIZE)
        grad = tl.load(dq + base[:, None] + js[None, :], mask=row_ok, other=0.0).to(tl.float32)
        grad += from_start[:, None] * carried + _mm(ED, kap_j, IEEE)
        if CENTERED:
            m = from_start[:, None] * tl.load(m_in + state * K + js)[None, :] + _mm(D, kap_j, IEEE)
            grad += dalpha[:, None] * m / n[:, None]
        if GATE:
            grad += dlam[:, None] * tl.load(gate_weight + i_h * K + js)[None, :]
            r_j = tl.load(r + base[:, None] + js[None, :], mask=row_ok, other=0.0).to(tl.float32)
            part = (c * tl.num_programs(1) + i_bh).to(tl.int64)  # [NT, B * H, K]
            tl.store(dweight_out + part * K + js, tl.sum(dlam[:, None] * r_j, 0))
        tl.store(dr + base[:, None] + js[None, :], grad.to(dr.dtype.element_ty), mask=row_ok)


@autotuned(configs=_BWD_CONFIGS, key=["H", "K", "C", "CENTERED", "NORMALIZE", "GATE", "IEEE"])
@triton.jit
def _ccq_bwd_query_kernel(
    r, kappa, log_gamma, lam, gate_weight, gate_bias, lam_max, P_in, m_in, n_in, dq,
    dr, dPu_out, dm_out, dn_out, dlam_out, dweight_out,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    CENTERED: tl.constexpr, NORMALIZE: tl.constexpr, GATE: tl.constexpr, IEEE: tl.constexpr,
):
    """Per chunk: recomputes the forward's Pu, m, n, then dlam, dPu, dm, dn and dr. NORMALIZE: kappa
    holds raw keys, normalised here as in the forward. GATE: lambda = lam_max sigmoid(a . r + b)
    formed here; dlam_out then receives d logit = dlam lam_max s (1 - s), dr includes d logit a, and
    dweight_out[c, b, h] this chunk's sum_t d logit_t r_t (the gate weight's gradient, in parts)."""
    c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    state = (i_bh * (NT + 1) + c).to(tl.int64)
    pos, t, t_ok, _g, b, base = chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    from_start = tl.exp(b)
    D = in_chunk_decays(pos, t_ok, b)
    row_ok = t_ok[:, None]

    scores = tl.zeros([C, C], dtype=tl.float32)
    r_dot_m_in = tl.zeros([C], dtype=tl.float32)
    key_squares = tl.zeros([C], dtype=tl.float32)
    gate_logit = tl.zeros([C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        r_k = tl.load(r + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        kap_k = tl.load(kappa + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        scores += _mm(r_k, tl.trans(kap_k), IEEE)
        r_dot_m_in += tl.sum(r_k.to(tl.float32) * tl.load(m_in + state * K + ks)[None, :], 1)
        if NORMALIZE:
            key_squares += tl.sum(kap_k.to(tl.float32) * kap_k.to(tl.float32), 1)
        if GATE:
            gate_logit += tl.sum(r_k.to(tl.float32) * tl.load(gate_weight + i_h * K + ks)[None, :], 1)
    inv_norm = 1.0 / tl.maximum(tl.sqrt(key_squares), 1e-6)
    if NORMALIZE:
        scores = scores * inv_norm[None, :]
    if GATE:
        gate = tl.sigmoid(gate_logit + tl.load(gate_bias + i_h))
        lam_t = tl.where(t_ok, lam_max * gate, 0.0)
    else:
        lam_t = tl.load(lam + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0).to(tl.float32)
    A = scores * D
    n = tl.where(t_ok, from_start * tl.load(n_in + state) + tl.sum(D, 1), 1.0)
    m_dot_r = from_start * r_dot_m_in + tl.sum(A, 1)
    alpha = m_dot_r / n

    # Pass 1: the per-position sums dlam, ds . m, ds . Pu.
    dlam, ds_dot_m, ds_dot_Pu = _query_pass_sums(r, kappa, m_in, P_in, dq, base, row_ok, state, inv_norm,
                                                 from_start, A, D, n, alpha, lam_t,
                                                 C, K, BK, CENTERED, NORMALIZE, IEEE)
    if CENTERED:
        dalpha = -ds_dot_m / n
        dmu_dot_m = -alpha * ds_dot_m + dalpha * m_dot_r
        dn = -ds_dot_Pu / (n * n) - dmu_dot_m / (n * n)
    else:
        dalpha = tl.zeros([C], dtype=tl.float32)
        dn = -ds_dot_Pu / (n * n)
    if GATE:
        dlam = dlam * lam_max * gate * (1.0 - gate)  # now d logit

    # Pass 2: dPu and dm (to memory, for the key gradients) and E = dPu kappa^T.
    E = _query_pass_dPu(r, kappa, dq, dPu_out, dm_out, base, row_ok, inv_norm, n, alpha, dalpha, lam_t,
                        C, K, BK, CENTERED, NORMALIZE, IEEE)
    out = (i_b * T + t) * H + i_h
    tl.store(dn_out + out, dn, mask=t_ok)
    tl.store(dlam_out + out, dlam, mask=t_ok)
    tl.debug_barrier()  # dPu of this chunk, just written by other threads of this program, is read below

    # Pass 3: dr = dq + dalpha mu + P_t dPu_t (+ d logit a with GATE).
    _query_pass_dr(r, kappa, m_in, P_in, dq, dr, dPu_out, gate_weight, dweight_out, base, row_ok, state, inv_norm,
                   from_start, E * D, D, n, dalpha, dlam, c, i_bh, i_h, C, K, BK, CENTERED, NORMALIZE, GATE, IEEE)


@autotuned(configs=_LOCAL_CONFIGS, key=["H", "K", "C", "IEEE"])
@triton.jit
def _ccq_bwd_local_kernel(
    r, dPu, dm, dn, log_gamma, Q, g_acc, h_acc, chunk_decay_rev,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CENTERED: tl.constexpr, IEEE: tl.constexpr,
):
    """Every chunk c in parallel: sum_{t in c} exp(b_t) (dPu_t r_t^T + r_t dPu_t^T), and exp(b_t) dm_t,
    exp(b_t) dn_t: what chunk c adds to the anti-causal sums of the chunks before it. Written in reverse
    chunk order (slot NT - c) so that the forward scan kernel accumulates them from the end."""
    i_cbh, i_k, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh, c = i_cbh // NT, i_cbh % NT
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_k * BK + tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    _pos, t, t_ok, g, b, base = chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    from_start = tl.where(t_ok, tl.exp(b), 0.0)  # decay from the end of chunk c - 1 to t
    row_ok = t_ok[:, None]
    dPu_rows = tl.load(dPu + base[:, None] + rows[None, :], mask=row_ok, other=0.0) * from_start[:, None]
    dPu_cols = tl.load(dPu + base[:, None] + cols[None, :], mask=row_ok, other=0.0) * from_start[:, None]
    r_rows = tl.load(r + base[:, None] + rows[None, :], mask=row_ok, other=0.0).to(tl.float32)
    r_cols = tl.load(r + base[:, None] + cols[None, :], mask=row_ok, other=0.0).to(tl.float32)
    local = _mm(tl.trans(dPu_rows), r_cols, IEEE) + _mm(tl.trans(r_rows), dPu_cols, IEEE)
    slot = (i_bh * (NT + 1) + NT - c).to(tl.int64)
    tl.store(Q + slot * K * K + rows[:, None] * K + cols[None, :], local.to(Q.dtype.element_ty))
    if i_v == 0:
        if CENTERED:
            dm_rows = tl.load(dm + base[:, None] + rows[None, :], mask=row_ok, other=0.0)
            tl.store(g_acc + slot * K + rows, tl.sum(dm_rows * from_start[:, None], 0))
        else:
            tl.store(g_acc + slot * K + rows, tl.zeros([BK], dtype=tl.float32))
        if i_k == 0:
            dn_t = tl.load(dn + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0)
            tl.store(h_acc + slot, tl.sum(dn_t * from_start, 0))
            # Reverse order: step j of the scan crosses chunk NT - 1 - j.
            tl.store(chunk_decay_rev + i_bh * NT + NT - 1 - c, tl.sum(g, 0))


@autotuned(configs=_BWD_CONFIGS, key=["H", "K", "C", "CENTERED", "NORMALIZE", "IEEE"])
@triton.jit
def _ccq_bwd_key_kernel(
    r, kappa, log_gamma, dPu, dm, dn, Q, g_acc, h_acc,
    dkappa, dk, dc,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    CENTERED: tl.constexpr, NORMALIZE: tl.constexpr, IEEE: tl.constexpr,
):
    """Per chunk: dkappa (in-chunk part plus the decayed sums of the later chunks) and d c = -Y.
    NORMALIZE: kappa holds raw keys k, kappa = k / max(||k||, 1e-6); dkappa (fp32) is then scratch and
    dk receives the raw keys' gradient (dkappa - kappa (kappa . dkappa)) / ||k|| (dkappa / 1e-6 when
    ||k|| <= 1e-6, where the clamp holds)."""
    c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    # The scan left in slot NT - 1 - c the sums over chunks c + 1 .. NT - 1, decayed to the end of c.
    later = (i_bh * (NT + 1) + NT - 1 - c).to(tl.int64)
    pos, t, t_ok, g, b, base = chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    to_end = tl.where(t_ok, tl.exp(tl.sum(g, 0) - b), 0.0)
    D = in_chunk_decays(pos, t_ok, b)
    row_ok = t_ok[:, None]
    out = (i_b * T + t) * H + i_h

    scores = tl.zeros([C, C], dtype=tl.float32)  # r_t . kappa_i
    E = tl.zeros([C, C], dtype=tl.float32)  # dPu_t . kappa_i
    key_squares = tl.zeros([C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kap_k = tl.load(kappa + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        scores += _mm(tl.load(r + base[:, None] + ks[None, :], mask=row_ok, other=0.0), tl.trans(kap_k), IEEE)
        E += _mm(tl.load(dPu + base[:, None] + ks[None, :], mask=row_ok, other=0.0), tl.trans(kap_k), IEEE)
        if NORMALIZE:
            key_squares += tl.sum(kap_k.to(tl.float32) * kap_k.to(tl.float32), 1)
    norms = tl.sqrt(key_squares)
    inv_norm = 1.0 / tl.maximum(norms, 1e-6)
    if NORMALIZE:
        scores = scores * inv_norm[None, :]
        E = E * inv_norm[None, :]
    A_T = tl.trans(scores * D)
    E_T = tl.trans(E * D)
    D_T = tl.trans(D)
    dn_t = tl.load(dn + out, mask=t_ok, other=0.0)
    Y = tl.sum(D * dn_t[:, None], 0) + to_end * tl.load(h_acc + later)
    radial = tl.zeros([C], dtype=tl.float32)  # kappa . dkappa (NORMALIZE)
    for j0 in range(0, K, BK):
        js = j0 + tl.arange(0, BK)
        carried = _rows_times_state(kappa, base, row_ok, Q + later * K * K, js, C, K, BK, IEEE)
        if NORMALIZE:
            carried = carried * inv_norm[:, None]
        dPu_j = tl.load(dPu + base[:, None] + js[None, :], mask=row_ok, other=0.0)
        r_j = tl.load(r + base[:, None] + js[None, :], mask=row_ok, other=0.0)
        grad_Q = _mm(A_T, dPu_j, IEEE) + _mm(E_T, r_j, IEEE) + to_end[:, None] * carried
        grad_m = to_end[:, None] * tl.load(g_acc + later * K + js)[None, :]
        if CENTERED:
            grad_m += _mm(D_T, tl.load(dm + base[:, None] + js[None, :], mask=row_ok, other=0.0), IEEE)
        kap_j = _unit_rows(kappa, base, row_ok, js, inv_norm, NORMALIZE)
        Y += tl.sum(kap_j * (0.5 * grad_Q + grad_m), 1)
        grad = grad_Q + grad_m
        radial += tl.sum(kap_j * grad, 1)
        tl.store(dkappa + base[:, None] + js[None, :], grad.to(dkappa.dtype.element_ty), mask=row_ok)
    tl.store(dc + out, -Y, mask=t_ok)
    if NORMALIZE:
        tl.debug_barrier()  # dkappa, just written by other threads of this program, is read below
        radial = tl.where(norms > 1e-6, radial, 0.0)
        for j0 in range(0, K, BK):
            js = j0 + tl.arange(0, BK)
            grad = tl.load(dkappa + base[:, None] + js[None, :], mask=row_ok, other=0.0)
            kap_j = _unit_rows(kappa, base, row_ok, js, inv_norm, NORMALIZE)
            dk_j = (grad - kap_j * radial[:, None]) * inv_norm[:, None]
            tl.store(dk + base[:, None] + js[None, :], dk_j.to(dk.dtype.element_ty), mask=row_ok)


@launches_on_input_device
def ccq_order1_backward(r, kappa, log_gamma, lam, dq, P_in, m_in, n_in, centered: bool = True,
                        chunk_size: int = CHUNK, raw_keys: bool = False, gate=None):
    """(dr, dkappa, dlog_gamma, dlam) for a call of `ccq_order1_forward` from a zero state, given the
    chunk states (P_in, m_in, n_in) that the forward computed. raw_keys and gate as in the forward:
    with raw_keys, kappa holds the raw keys and the second gradient is theirs; with gate (a, b, lam_max),
    lam is not read and the result is (dr, dkappa, dlog_gamma, dlogit, da): dr includes dlogit a, dlogit
    [B, T, H] is the gradient of the gate's logit a . r + b (so db = dlogit summed over B and T) and da
    [H, K] fp32 the gate weight's. The chain rules of the normalisation and the gate run in the
    kernels: no elementwise torch passes over [B, T, H, K] around them."""
    B, T, H, K = r.shape
    C = chunk_size
    NT = triton.cdiv(T, C)
    ieee = r.dtype == torch.float32
    dq = dq.contiguous()
    f32 = dict(device=r.device, dtype=torch.float32)
    # dPu, dm and the anti-causal sums Q are only ever tensor-core operands (converted to the input
    # dtype there), so outside fp32 they are stored in it: half the memory traffic.
    work = dict(device=r.device, dtype=torch.float32 if ieee else r.dtype)
    dPu, dm = torch.empty(B, T, H, K, **work), torch.empty(B, T, H, K, **work)
    dn, dlam = torch.empty(B, T, H, **f32), torch.empty(B, T, H, **f32)
    dr = torch.empty_like(r)
    if gate is not None:
        gate_weight, gate_bias, lam_max = kernel_gate(gate, H, K, r.device)
        dweight_parts = torch.empty(NT, B, H, K, **f32)
    else:
        gate_weight = gate_bias = dweight_parts = log_gamma  # unused placeholders
        lam_max = 0.0
    _ccq_bwd_query_kernel[(NT, B * H)](
        r, kappa, log_gamma, lam if lam is not None else log_gamma, gate_weight, gate_bias, lam_max,
        P_in, m_in, n_in, dq, dr, dPu, dm, dn, dlam, dweight_parts, T, NT,
        H=H, K=K, C=C, CENTERED=bool(centered), NORMALIZE=raw_keys, GATE=gate is not None, IEEE=ieee,
    )
    # Anti-causal sums, accumulated from the last chunk backwards by the forward's scan kernel.
    Q = torch.empty(B * H, NT + 1, K, K, **work)
    g_acc, h_acc = torch.empty(B * H, NT + 1, K, **f32), torch.empty(B * H, NT + 1, **f32)
    decay_rev = torch.empty(B * H, NT, **f32)
    local_grid = lambda meta: (NT * B * H, K // meta["BK"], K // meta["BV"])  # noqa: E731
    _ccq_bwd_local_kernel[local_grid](r, dPu, dm, dn, log_gamma, Q, g_acc, h_acc, decay_rev, T, NT,
                                      H=H, K=K, C=C, CENTERED=bool(centered), IEEE=ieee)
    scan_states(Q, g_acc, h_acc, decay_rev, NT, K)
    dkappa = torch.empty(B, T, H, K, **f32) if raw_keys else torch.empty_like(kappa)
    dk = torch.empty_like(kappa) if raw_keys else dkappa
    dc = torch.empty(B, T, H, **f32)
    _ccq_bwd_key_kernel[(NT, B * H)](
        r, kappa, log_gamma, dPu, dm, dn, Q, g_acc, h_acc, dkappa, dk, dc, T, NT,
        H=H, K=K, C=C, CENTERED=bool(centered), NORMALIZE=raw_keys, IEEE=ieee,
    )
    # Sums over t >= j along time, time made the innermost axis: torch scans an outer axis with one
    # thread per inner element (B * H of them), which is slow.
    dlog_gamma = dc.transpose(1, 2).flip(-1).cumsum(-1).flip(-1).transpose(1, 2)
    if gate is not None:
        return dr, dk, dlog_gamma, dlam, dweight_parts.sum((0, 1))
    return dr, dk, dlog_gamma, dlam


