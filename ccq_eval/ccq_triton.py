"""Fused Triton forward of the CCQ read of order 1 (the default), for CUDA.

The unfused kernel path (`ccq._ccq_chunk_kernel`) spends about 60 kernel launches per layer (the
decayed sums m and n, fla's chunk_simple_gla with its own preparation kernels, and the polynomial):
on the H200 that host-side cost, not arithmetic, made CCQ 1.6-2x slower than the backbone. Here the
whole read is three kernels:

1. `_ccq_local_state_kernel`: every chunk in parallel, its own decayed sum of kappa kappa^T (and of
   kappa and 1 for m, n).
2. `_ccq_state_scan_kernel`: one elementwise pass over the chunks turns those into the state entering
   every chunk, P_in[c] = sum_{i < start(c)} w kappa_i kappa_i^T, m_in[c], n_in[c]. (A single
   sequential kernel with a matmul per chunk, as fla's chunk_fwd_h, was latency-bound: 88 us per
   layer at 4K tokens on the H200, five times that at 20K.)
3. `_ccq_read_kernel`: every chunk in parallel; the in-chunk cumulative decay, the intra-chunk part
   (r kappa^T masked by the decays) @ kappa, the carried part r @ P_in[c], the counts n_t, means mu_t,
   the gate product and q~ = r - lambda Sigma r, written once in the input dtype.

No [T, K, K] tensor is formed: P_in holds one K x K matrix per chunk, in the input dtype like fla's
chunk states (fp32 when the inputs are fp32). Sums over keys (n, m, the polynomial) are fp32.

Kernels run on CUDA; with TRITON_INTERPRET=1 (set before this module is imported) they run on CPU
tensors, which is how the CPU tests check them against `ccq.ccq_read_reference`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CHUNK = 64


# Few candidates on purpose: each compiles on the first call of a shape.
_LOCAL_CONFIGS = [triton.Config({"BK": bk, "BV": bk}, num_warps=warps, num_stages=2)
                  for bk in (32, 64) for warps in (4, 8)]
_SCAN_CONFIGS = [triton.Config({"BLOCK": block}, num_warps=4, num_stages=stages)
                 for block in (512, 1024) for stages in (2, 3)]
_READ_CONFIGS = [triton.Config({"BK": 64, "BV": bv}, num_warps=warps, num_stages=2)
                 for bv in (32, 64) for warps in (4, 8)]


class _FirstConfig:
    """Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) cannot time candidates: use the first."""

    def __init__(self, configs, key):
        self.kwargs = dict(configs[0].kwargs)

    def __call__(self, kernel):
        self.kernel = kernel
        return self

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            grid_now = grid(self.kwargs) if callable(grid) else grid
            return self.kernel[grid_now](*args, **kwargs, **self.kwargs)

        return launch


_tuned = _FirstConfig if os.environ.get("TRITON_INTERPRET") == "1" else triton.autotune


@_tuned(configs=_LOCAL_CONFIGS, key=["H", "K", "C", "IEEE"])
@triton.jit
def _ccq_local_state_kernel(
    kappa, log_gamma, P_in, m_in, n_in, chunk_decay,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Every chunk in parallel: its own decayed sums, sum_{i in c} exp(G_c - b_i) kappa_i kappa_i^T
    (and m, n alike), written to slot c + 1 of P_in / m_in / n_in for the scan to accumulate; the
    chunk's total log decay G_c goes to chunk_decay."""
    i_k, i_v, i_cbh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh, c = i_cbh // NT, i_cbh % NT
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_k * BK + tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    pos = tl.arange(0, C)
    t = c * C + pos
    t_ok = t < T
    # Padded steps past T: log decay 0 and zero keys, so they change nothing.
    g = tl.load(log_gamma + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0).to(tl.float32)
    b = tl.cumsum(g, 0)
    g_chunk = tl.sum(g, 0)
    to_end = tl.where(t_ok, tl.exp(g_chunk - b), 0.0)  # decay from step i to the end of the chunk
    base = ((i_b * T + t) * H + i_h).to(tl.int64) * K
    k_rows = tl.load(kappa + base[:, None] + rows[None, :], mask=t_ok[:, None], other=0.0)
    k_cols = tl.load(kappa + base[:, None] + cols[None, :], mask=t_ok[:, None], other=0.0)
    weighted = k_rows.to(tl.float32) * to_end[:, None]
    if IEEE:
        local = tl.dot(tl.trans(weighted), k_cols.to(tl.float32), input_precision="ieee")
    else:
        local = tl.dot(tl.trans(weighted.to(k_cols.dtype)), k_cols)
    slot = (i_bh * (NT + 1) + c + 1).to(tl.int64)
    tl.store(P_in + slot * K * K + rows[:, None] * K + cols[None, :], local.to(P_in.dtype.element_ty))
    if i_v == 0:
        tl.store(m_in + slot * K + rows, tl.sum(weighted, 0))
        if i_k == 0:
            tl.store(n_in + slot, tl.sum(to_end, 0))
            tl.store(chunk_decay + i_bh * NT + c, g_chunk)


@_tuned(configs=_SCAN_CONFIGS, key=["K", "HAS_INITIAL", "STORE_FINAL"])
@triton.jit
def _ccq_state_scan_kernel(
    P_in, m_in, n_in, chunk_decay, P0, m0, n0, P_final, m_final, n_final,
    NT,
    K: tl.constexpr, BLOCK: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    """In place over slots 0..NT: slot c becomes the state entering chunk c (slot NT: after the last),
    state_c = exp(G_{c-1}) state_{c-1} + local_{c-1}. Elementwise, so the serial loop only waits for
    loads that triton prefetches; programs 0..cdiv(K*K, BLOCK)-1 take blocks of P, the last one m, n."""
    i_blk, i_bh = tl.program_id(0), tl.program_id(1)
    n_blocks = tl.cdiv(K * K, BLOCK)
    offs = tl.arange(0, BLOCK)
    if i_blk < n_blocks:
        idx = i_blk * BLOCK + offs
        ok = idx < K * K
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_INITIAL:
            acc += tl.load(P0 + i_bh * K * K + idx, mask=ok, other=0.0)
        base = i_bh.to(tl.int64) * (NT + 1) * K * K
        tl.store(P_in + base + idx, acc.to(P_in.dtype.element_ty), mask=ok)
        for c in range(1, NT + 1):
            decay = tl.exp(tl.load(chunk_decay + i_bh * NT + c - 1))
            local = tl.load(P_in + base + c * K * K + idx, mask=ok, other=0.0).to(tl.float32)
            acc = acc * decay + local
            tl.store(P_in + base + c * K * K + idx, acc.to(P_in.dtype.element_ty), mask=ok)
        if STORE_FINAL:
            tl.store(P_final + i_bh * K * K + idx, acc, mask=ok)
    else:
        ok = offs < K
        m = tl.zeros([BLOCK], dtype=tl.float32)
        n = tl.sum(tl.zeros([1], dtype=tl.float32), 0)
        if HAS_INITIAL:
            m += tl.load(m0 + i_bh * K + offs, mask=ok, other=0.0)
            n += tl.load(n0 + i_bh)
        base = i_bh.to(tl.int64) * (NT + 1)
        tl.store(m_in + base * K + offs, m, mask=ok)
        tl.store(n_in + base, n)
        for c in range(1, NT + 1):
            decay = tl.exp(tl.load(chunk_decay + i_bh * NT + c - 1))
            m = m * decay + tl.load(m_in + (base + c) * K + offs, mask=ok, other=0.0)
            n = n * decay + tl.load(n_in + base + c)
            tl.store(m_in + (base + c) * K + offs, m, mask=ok)
            tl.store(n_in + base + c, n)
        if STORE_FINAL:
            tl.store(m_final + i_bh * K + offs, m, mask=ok)
            tl.store(n_final + i_bh, n)


@_tuned(configs=_READ_CONFIGS, key=["H", "K", "C", "CENTERED", "IEEE"])
@triton.jit
def _ccq_read_kernel(
    r, kappa, log_gamma, lam, P_in, m_in, n_in, q_out,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CENTERED: tl.constexpr, IEEE: tl.constexpr,
):
    i_v, c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    state = (i_bh * (NT + 1) + c).to(tl.int64)
    pos = tl.arange(0, C)
    t = c * C + pos
    t_ok = t < T
    g = tl.load(log_gamma + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0).to(tl.float32)
    b = tl.cumsum(g, 0)  # log decay from the chunk start to t
    from_start = tl.exp(b)
    causal = (pos[:, None] >= pos[None, :]) & t_ok[None, :]
    D = tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))  # D[t, i] = w_{i,t} inside the chunk
    base = ((i_b * T + t) * H + i_h).to(tl.int64) * K

    cols = i_v * BV + tl.arange(0, BV)
    col_ok = cols < K
    scores = tl.zeros([C, C], dtype=tl.float32)  # r_t . kappa_i
    carried = tl.zeros([C, BV], dtype=tl.float32)  # r_t @ P_in[c][:, cols]
    r_dot_m_in = tl.zeros([C], dtype=tl.float32)
    # Unrolled (K and BK are constants): the software-pipelined form of a one-trip loop (K = BK)
    # crashed with an illegal memory access on the H200 in bf16.
    for k0 in tl.static_range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        mask = t_ok[:, None] & k_ok[None, :]
        r_k = tl.load(r + base[:, None] + ks[None, :], mask=mask, other=0.0)
        kap_k = tl.load(kappa + base[:, None] + ks[None, :], mask=mask, other=0.0)
        P_k = tl.load(P_in + state * K * K + ks[:, None] * K + cols[None, :],
                      mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            scores += tl.dot(r_k.to(tl.float32), tl.trans(kap_k.to(tl.float32)), input_precision="ieee")
            carried += tl.dot(r_k.to(tl.float32), P_k.to(tl.float32), input_precision="ieee")
        else:
            scores += tl.dot(r_k, tl.trans(kap_k.to(r_k.dtype)))
            carried += tl.dot(r_k, P_k.to(r_k.dtype))
        m_k = tl.load(m_in + state * K + ks, mask=k_ok, other=0.0)
        r_dot_m_in += tl.sum(r_k.to(tl.float32) * m_k[None, :], 1)

    A = scores * D
    n = from_start * tl.load(n_in + state) + tl.sum(D, 1)
    n = tl.where(t_ok, n, 1.0)
    col_mask = t_ok[:, None] & col_ok[None, :]
    kap_v = tl.load(kappa + base[:, None] + cols[None, :], mask=col_mask, other=0.0)
    r_v = tl.load(r + base[:, None] + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
    if IEEE:
        Pu = from_start[:, None] * carried + tl.dot(A, kap_v.to(tl.float32), input_precision="ieee")
    else:
        Pu = from_start[:, None] * carried + tl.dot(A.to(kap_v.dtype), kap_v)
    sigma_r = Pu / n[:, None]
    if CENTERED:
        m_v = tl.load(m_in + state * K + cols, mask=col_ok, other=0.0)
        if IEEE:
            m = from_start[:, None] * m_v[None, :] + tl.dot(D, kap_v.to(tl.float32), input_precision="ieee")
        else:
            m = from_start[:, None] * m_v[None, :] + tl.dot(D.to(kap_v.dtype), kap_v)
        mu_dot_r = (from_start * r_dot_m_in + tl.sum(A, 1)) / n  # mu_t . r_t = (m_t . r_t) / n_t
        sigma_r -= (m / n[:, None]) * mu_dot_r[:, None]
    lam_t = tl.load(lam + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0).to(tl.float32)
    q = r_v - lam_t[:, None] * sigma_r
    tl.store(q_out + base[:, None] + cols[None, :], q.to(q_out.dtype.element_ty), mask=col_mask)


def supports_head_dim(K: int) -> bool:
    """Head dims that are whole 64-wide tiles (GLA-340M: 128, Gated DeltaNet-340M: 256). Narrower or
    ragged heads (masked tile columns) crashed with an illegal memory access on the H200 in bf16; they
    take the unfused path."""
    return K % 64 == 0


def ccq_order1_forward(r, kappa, log_gamma, lam, centered: bool = True, initial_state=None,
                       output_final_state: bool = False, chunk_size: int = CHUNK):
    """q~ = r - lam * Sigma r for r, kappa [B, T, H, K] (kappa unit keys), log_gamma, lam [B, T, H].

    initial_state: (P [B, H, K, K], m [B, H, K], n [B, H]) fp32, or None for zero. Returns q~ in r's
    dtype and the final (P, m, n) in fp32 (None unless output_final_state).
    """
    B, T, H, K = r.shape
    if not supports_head_dim(K):
        raise ValueError(f"the fused CCQ kernels need a head dim that is a multiple of 64, got {K}")
    C = chunk_size
    NT = triton.cdiv(T, C)
    ieee = r.dtype == torch.float32
    r, kappa = r.contiguous(), kappa.to(r.dtype).contiguous()
    log_gamma, lam = log_gamma.float().contiguous(), lam.float().contiguous()
    state_dtype = torch.float32 if ieee else r.dtype
    # Slot c: the state entering chunk c; slot NT: the state after the last chunk.
    P_in = torch.empty(B * H, NT + 1, K, K, device=r.device, dtype=state_dtype)
    m_in = torch.empty(B * H, NT + 1, K, device=r.device, dtype=torch.float32)
    n_in = torch.empty(B * H, NT + 1, device=r.device, dtype=torch.float32)
    chunk_decay = torch.empty(B * H, NT, device=r.device, dtype=torch.float32)
    final = None
    if output_final_state:
        final = (torch.empty(B, H, K, K, device=r.device, dtype=torch.float32),
                 torch.empty(B, H, K, device=r.device, dtype=torch.float32),
                 torch.empty(B, H, device=r.device, dtype=torch.float32))
    init = None if initial_state is None else tuple(s.float().contiguous() for s in initial_state)
    dummy = n_in  # stands in for absent optional pointers (never read or written)
    local_grid = lambda meta: (K // meta["BK"], K // meta["BV"], NT * B * H)  # noqa: E731
    _ccq_local_state_kernel[local_grid](kappa, log_gamma, P_in, m_in, n_in, chunk_decay, T, NT,
                                        H=H, K=K, C=C, IEEE=ieee)
    scan_grid = lambda meta: (triton.cdiv(K * K, meta["BLOCK"]) + 1, B * H)  # noqa: E731
    _ccq_state_scan_kernel[scan_grid](
        P_in, m_in, n_in, chunk_decay,
        *(init if init is not None else (dummy, dummy, dummy)),
        *(final if final is not None else (dummy, dummy, dummy)),
        NT, K=K, HAS_INITIAL=init is not None, STORE_FINAL=final is not None,
    )
    q = torch.empty_like(r)
    read_grid = lambda meta: (triton.cdiv(K, meta["BV"]), NT, B * H)  # noqa: E731
    _ccq_read_kernel[read_grid](
        r, kappa, log_gamma, lam, P_in, m_in, n_in, q,
        T, NT, H=H, K=K, C=C, CENTERED=bool(centered), IEEE=ieee,
    )
    return q, final
