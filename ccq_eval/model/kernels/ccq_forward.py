"""Fused Triton kernels for the forward of the CCQ read of order 1 (the default on CUDA for head dims
128 and 256; CCQ_EVAL_CCQ_KERNEL=unfused switches them off, see ccq.fused_kernel_enabled).

The unfused path (`ccq._ccq_chunk_kernel`) spends tens of kernel launches per layer (the decayed sums
m and n, fla's chunk_simple_gla with its preparation kernels, the polynomial), and on a fast GPU that
host-side cost, not arithmetic, bounds it. Here the whole read is four launches of three kernels:

1. `ccq_chunk_states_kernel`, run twice around a scan: the sums P = sum w kappa kappa^T, m and n,
   walked chunk by chunk (one tensor-core product per chunk, the state in registers) inside segments
   of the sequence that run in parallel. The first run sums each segment from zero;
2. `_ccq_state_scan_kernel` turns those sums into the state entering every segment (SCAN_STEPS
   segments loaded at once); the second run walks the segments again from their entering states and
   writes the state entering every chunk, P_in[c] = sum_{i < start(c)} w kappa_i kappa_i^T, m_in[c],
   n_in[c], once, so the K x K states go through memory once;
3. `_ccq_read_kernel`: every chunk in parallel; the in-chunk cumulative decay, the intra-chunk part
   (r kappa^T masked by the decays) @ kappa, the carried part r @ P_in[c], the counts n_t, means mu_t,
   the gate product and q~ = r - lambda Sigma r, written once in the input dtype. The chunk's scores
   r kappa^T are formed once per program, which then walks its columns of q~.

Kernels 1 and 2 live in `ccq_chunk_states` with the chunk layout all the kernels share; this module
holds the read kernel and the launcher. `ccq_decode` holds the one-token step and `ccq_backward` the
backward, which reuses these chunk states and the scan kernel. No [T, K, K] tensor is formed: P_in
holds one K x K matrix per chunk, in the input dtype like fla's chunk states (fp32 when the inputs
are fp32). Sums over keys (n, m, the polynomial) are fp32.

Kernels run on CUDA; with TRITON_INTERPRET=1 (set before this module is imported) they run on CPU
tensors, which is how the CPU tests check them against `ccq.ccq_read_reference`. Measurements of
each design choice: benchmarks/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ccq_eval.model.kernels.ccq_chunk_states import (
    CHUNK,
    STATE_ROWS,
    autotuned,
    ccq_chunk_states_kernel,
    chunk_rows,
    chunks_per_segment,
    in_chunk_decays,
    scan_states,
)
from ccq_eval.model.kernels.triton_device import launches_on_input_device

# The read kernel: SPLIT programs per chunk share the K columns of q~; each computes the chunk's
# scores r kappa^T once and then walks its columns in BV-wide blocks. WHOLE: the chunk's K-wide rows
# of r and kappa are loaded once and every product is one dot over the whole head dim (more registers
# and shared memory, fewer programs per SM); otherwise the products walk K in BK-wide tiles. The tiled
# kernel with 4 warps and 3 or 4 stages is listed because it was the fastest measured
# (benchmarks/tune_ccq.py); with 4 warps the whole-K kernel spills, so it keeps 8.
_READ_CONFIGS = ([triton.Config({"BK": 32, "BV": 64, "SPLIT": split, "WHOLE": whole}, num_warps=8,
                                num_stages=2) for whole in (False, True) for split in (1, 2)]
                 + [triton.Config({"BK": 32, "BV": 64, "SPLIT": 1, "WHOLE": False}, num_warps=4,
                                  num_stages=stages) for stages in (3, 4)])


NORM_TILE = 16384  # entries per program of _inverse_norms_kernel


@triton.jit
def _inverse_norms_kernel(x, inv_norm, N, K: tl.constexpr, ROWS: tl.constexpr):
    """1 / max(||x_i||, 1e-6) for the N rows of K entries of x (ccq.unit_keys), in fp32. Once per call
    of the forward, for its state and read kernels: inside them the norms of a chunk's keys would take
    a cross-warp reduction per chunk and program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < N
    v = tl.load(x + rows[:, None].to(tl.int64) * K + tl.arange(0, K)[None, :], mask=ok[:, None], other=0.0)
    v = v.to(tl.float32)
    tl.store(inv_norm + rows, 1.0 / tl.maximum(tl.sqrt(tl.sum(v * v, 1)), 1e-6), mask=ok)



@triton.jit
def _sigma_r_columns(r, m_in, carried, kap_v, A, D, from_start, n, mu_dot_r, state, cols, col_in,
                     K: tl.constexpr, CENTERED: tl.constexpr, IEEE: tl.constexpr):
    """Columns `cols` (mask col_in) of Sigma_t r_t = Pu_t / n_t - mu_t (mu_t . r_t) for the read kernel's
    chunk, fp32 [C, BW] (the mean term only when CENTERED): Pu = exp(b) carried + A @ kap_v and
    m = exp(b) m_in[c] + D @ kap_v, where carried = r_t @ P_in[c][:, cols] and kap_v holds the chunk's
    unit keys on those columns. The products take kap_v in fp32 with IEEE, else in r's dtype (that of
    A and D then)."""
    if IEEE:
        kap_v = kap_v.to(tl.float32)
        Pu = from_start[:, None] * carried + tl.dot(A, kap_v, input_precision="ieee")
    else:
        kap_v = kap_v.to(r.dtype.element_ty)
        Pu = from_start[:, None] * carried + tl.dot(A, kap_v)
    sigma_r = Pu / n[:, None]
    if CENTERED:
        m_v = tl.load(m_in + state * K + cols, mask=col_in, other=0.0)
        if IEEE:
            m = from_start[:, None] * m_v[None, :] + tl.dot(D, kap_v, input_precision="ieee")
        else:
            m = from_start[:, None] * m_v[None, :] + tl.dot(D, kap_v)
        sigma_r -= (m / n[:, None]) * mu_dot_r[:, None]
    return sigma_r


@triton.jit
def _whole_chunk_sums(r, kappa, m_in, gate_weight, base, row_ok, state, i_h, C: tl.constexpr, K: tl.constexpr,
                      GATE: tl.constexpr, IEEE: tl.constexpr):
    """The read kernel's per-chunk sums over the head dim with the chunk's K-wide rows loaded at once:
    those rows of r (kept for the carried products), the scores r_t . kappa_i [C, C] fp32, r_t . m_in[c]
    and the gate logit a_h . r_t (zero without GATE)."""
    ks = tl.arange(0, K)
    gate_logit = tl.zeros([C], dtype=tl.float32)
    r_all = tl.load(r + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
    kap_all = tl.load(kappa + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
    if IEEE:
        scores = tl.dot(r_all.to(tl.float32), tl.trans(kap_all.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(r_all, tl.trans(kap_all.to(r_all.dtype)))
    r_dot_m_in = tl.sum(r_all.to(tl.float32) * tl.load(m_in + state * K + ks)[None, :], 1)
    if GATE:
        gate_logit = tl.sum(r_all.to(tl.float32) * tl.load(gate_weight + i_h * K + ks)[None, :], 1)
    return r_all, scores, r_dot_m_in, gate_logit


@triton.jit
def _tiled_chunk_sums(r, kappa, m_in, gate_weight, base, row_ok, state, i_h, C: tl.constexpr, K: tl.constexpr,
                      BK: tl.constexpr, GATE: tl.constexpr, IEEE: tl.constexpr):
    """_whole_chunk_sums' scores, r_t . m_in[c] and gate logit, the head dim walked in BK-wide tiles."""
    scores = tl.zeros([C, C], dtype=tl.float32)
    r_dot_m_in = tl.zeros([C], dtype=tl.float32)
    gate_logit = tl.zeros([C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        r_k = tl.load(r + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        kap_k = tl.load(kappa + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        if IEEE:
            scores += tl.dot(r_k.to(tl.float32), tl.trans(kap_k.to(tl.float32)), input_precision="ieee")
        else:
            scores += tl.dot(r_k, tl.trans(kap_k.to(r_k.dtype)))
        r_dot_m_in += tl.sum(r_k.to(tl.float32) * tl.load(m_in + state * K + ks)[None, :], 1)
        if GATE:
            gate_logit += tl.sum(r_k.to(tl.float32) * tl.load(gate_weight + i_h * K + ks)[None, :], 1)
    return scores, r_dot_m_in, gate_logit


@autotuned(configs=_READ_CONFIGS, key=["H", "K", "C", "CENTERED", "NORMALIZE", "GATE", "IEEE"])
@triton.jit
def _ccq_read_kernel(
    r, kappa, key_inv_norm, log_gamma, lam, gate_weight, gate_bias, lam_max, P_in, m_in, n_in, q_out,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SPLIT: tl.constexpr, WHOLE: tl.constexpr,
    CENTERED: tl.constexpr, NORMALIZE: tl.constexpr, GATE: tl.constexpr, IEEE: tl.constexpr,
):
    i_s, c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    state = (i_bh * (NT + 1) + c).to(tl.int64)
    pos, t, t_ok, _g, b, base = chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    row_ok = t_ok[:, None]
    from_start = tl.exp(b)
    D = in_chunk_decays(pos, t_ok, b)

    # Per chunk, once: the scores r_t . kappa_i and the per-position sums over the head dim.
    if WHOLE:  # the chunk's K-wide rows of r and kappa held once, every product one dot over K
        ks = tl.arange(0, K)
        r_all, scores, r_dot_m_in, gate_logit = _whole_chunk_sums(r, kappa, m_in, gate_weight, base, row_ok,
                                                                  state, i_h, C, K, GATE, IEEE)
    else:
        scores, r_dot_m_in, gate_logit = _tiled_chunk_sums(r, kappa, m_in, gate_weight, base, row_ok, state,
                                                           i_h, C, K, BK, GATE, IEEE)
    if NORMALIZE:  # raw keys in: kappa = k / max(||k||, 1e-6)
        inv_norm = tl.load(key_inv_norm + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0)
        scores = scores * inv_norm[None, :]
    A = scores * D
    n = tl.where(t_ok, from_start * tl.load(n_in + state) + tl.sum(D, 1), 1.0)
    mu_dot_r = (from_start * r_dot_m_in + tl.sum(A, 1)) / n  # mu_t . r_t = (m_t . r_t) / n_t
    if GATE:
        lam_t = lam_max * tl.sigmoid(gate_logit + tl.load(gate_bias + i_h))
    else:
        lam_t = tl.load(lam + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0).to(tl.float32)
    if not IEEE:  # the tensor-core operands, converted once
        A = A.to(r.dtype.element_ty)
        D = D.to(r.dtype.element_ty)

    # This program's columns of q~, BW at a time: q~ = r - lambda (Pu / n - mu (mu . r)).
    COLS: tl.constexpr = K // SPLIT
    BW: tl.constexpr = BV if BV <= COLS else COLS
    col_end = (i_s + 1) * COLS
    for j0 in range(i_s * COLS, col_end, BW):
        cols = j0 + tl.arange(0, BW)
        col_in = cols < col_end
        col_mask = row_ok & col_in[None, :]
        if WHOLE:  # r_t @ P_in[c][:, cols]
            P_v = tl.load(P_in + state * K * K + ks[:, None] * K + cols[None, :], mask=col_in[None, :],
                          other=0.0)
            if IEEE:
                carried = tl.dot(r_all.to(tl.float32), P_v.to(tl.float32), input_precision="ieee")
            else:
                carried = tl.dot(r_all, P_v.to(r_all.dtype))
        else:
            carried = tl.zeros([C, BW], dtype=tl.float32)  # r_t @ P_in[c][:, cols]
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                r_k = tl.load(r + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
                P_k = tl.load(P_in + state * K * K + ks[:, None] * K + cols[None, :], mask=col_in[None, :],
                              other=0.0)
                if IEEE:
                    carried += tl.dot(r_k.to(tl.float32), P_k.to(tl.float32), input_precision="ieee")
                else:
                    carried += tl.dot(r_k, P_k.to(r_k.dtype))
        kap_v = tl.load(kappa + base[:, None] + cols[None, :], mask=col_mask, other=0.0)
        if NORMALIZE:
            kap_v = (kap_v.to(tl.float32) * inv_norm[:, None]).to(kap_v.dtype)
        sigma_r = _sigma_r_columns(r, m_in, carried, kap_v, A, D, from_start, n, mu_dot_r, state, cols,
                                   col_in, K, CENTERED, IEEE)
        r_v = tl.load(r + base[:, None] + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
        q = r_v - lam_t[:, None] * sigma_r
        tl.store(q_out + base[:, None] + cols[None, :], q.to(q_out.dtype.element_ty), mask=col_mask)


FORWARD_HEAD_DIMS = (64, 128, 256)


def supports_head_dim(K: int) -> bool:
    """Head dims the fused kernels serve: 128 (GLA-340M) and 256 (Gated DeltaNet-340M), the ones checked
    on a GPU. Others take the unfused path: 32 and 64 because the read kernel failed with them in bf16
    (benchmarks/README.md), wider heads because the state kernel keeps K-wide rows in registers."""
    return K in (128, 256)



def kernel_gate(gate, H: int, K: int, device):
    """The kernels' gate arguments from gate = (a [H, K] or None, b [H], lam_max): a and b fp32 and
    contiguous, lam_max a float. A None weight is the constant gate lambda = lam_max sigmoid(b), which
    the kernels compute with a zero weight."""
    weight, bias, lam_max = gate
    weight = torch.zeros(H, K, device=device) if weight is None else weight.float().contiguous()
    return weight, bias.float().contiguous(), float(lam_max)


@launches_on_input_device
def ccq_order1_forward(r, kappa, log_gamma, lam, centered: bool = True, initial_state=None,
                       output_final_state: bool = False, chunk_size: int = CHUNK,
                       return_chunk_states: bool = False, raw_keys: bool = False, gate=None,
                       segment_chunks: int | None = None):
    """q~ = r - lam * Sigma r for r, kappa [B, T, H, K] (kappa unit keys), log_gamma, lam [B, T, H].

    initial_state: (P [B, H, K, K], m [B, H, K], n [B, H]) fp32, or None for zero. Returns q~ in r's
    dtype and the final (P, m, n) in fp32 (None unless output_final_state); with return_chunk_states
    also the states entering every chunk (P_in, m_in, n_in), which the backward reuses.
    raw_keys: kappa holds the layer's keys, normalised in the kernels. gate: (a [H, K] or None for the
    constant gate, b [H], lam_max) instead of lam, lambda_t = lam_max * sigmoid(a_h . r_t + b_h)
    computed in the kernel. Both save the separate elementwise passes (autograd is not tracked here:
    training reaches this through ccq._FusedOrder1Keys and ccq_order1_backward).
    segment_chunks: chunks per segment of the state kernel (None: from the GPU's size; tests set it).
    """
    B, T, H, K = r.shape
    if K not in FORWARD_HEAD_DIMS:  # whole 64-wide tiles; the state kernel holds K-wide rows
        raise ValueError(f"the fused CCQ kernels need a head dim in {FORWARD_HEAD_DIMS}, got {K}")
    C = chunk_size
    NT = triton.cdiv(T, C)
    ieee = r.dtype == torch.float32
    r, kappa = r.contiguous(), kappa.to(r.dtype).contiguous()
    log_gamma = log_gamma.float().contiguous()
    lam = log_gamma if lam is None else lam.float().contiguous()  # with a gate, lam is never read
    if gate is not None:
        gate_weight, gate_bias, lam_max = kernel_gate(gate, H, K, r.device)
    else:
        gate_weight, gate_bias, lam_max = log_gamma, log_gamma, 0.0  # unused placeholders
    state_dtype = torch.float32 if ieee else r.dtype
    # Slot c: the state entering chunk c; slot NT: the state after the last chunk.
    P_in = torch.empty(B * H, NT + 1, K, K, device=r.device, dtype=state_dtype)
    m_in = torch.empty(B * H, NT + 1, K, device=r.device, dtype=torch.float32)
    n_in = torch.empty(B * H, NT + 1, device=r.device, dtype=torch.float32)
    final = None
    if output_final_state:
        final = (torch.empty(B, H, K, K, device=r.device, dtype=torch.float32),
                 torch.empty(B, H, K, device=r.device, dtype=torch.float32),
                 torch.empty(B, H, device=r.device, dtype=torch.float32))
    init = None if initial_state is None else tuple(s.float().contiguous() for s in initial_state)
    key_inv_norm = log_gamma  # placeholder, never read
    if raw_keys:
        key_inv_norm = torch.empty(B * T * H, device=r.device, dtype=torch.float32)
        _inverse_norms_kernel[(triton.cdiv(B * T * H, NORM_TILE // K),)](kappa, key_inv_norm, B * T * H, K=K,
                                                                          ROWS=NORM_TILE // K, num_warps=4)
    SEG = segment_chunks or chunks_per_segment(NT, K // STATE_ROWS * H, r.device)
    NSEG = triton.cdiv(NT, SEG)
    # Segment slot s: the sums over segment s - 1, which the scan turns into the state entering s.
    seg_P = torch.empty(B * H, NSEG + 1, K, K, device=r.device, dtype=torch.float32)
    seg_m = torch.empty(B * H, NSEG + 1, K, device=r.device, dtype=torch.float32)
    seg_n = torch.empty(B * H, NSEG + 1, device=r.device, dtype=torch.float32)
    seg_decay = torch.empty(B * H, NSEG, device=r.device, dtype=torch.float32)
    for states in (False, True):
        ccq_chunk_states_kernel[(K // STATE_ROWS, NSEG, B * H)](
            kappa, key_inv_norm, log_gamma, seg_P, seg_m, seg_n, seg_decay, P_in, m_in, n_in,
            T, NT, NSEG, SEG, H=H, K=K, C=C, BR=STATE_ROWS, NORMALIZE=raw_keys, IEEE=ieee, STATES=states)
        if not states:
            scan_states(seg_P, seg_m, seg_n, seg_decay, NSEG, K, init, final)
    q = torch.empty_like(r)
    read_grid = lambda meta: (meta["SPLIT"], NT, B * H)  # noqa: E731
    _ccq_read_kernel[read_grid](
        r, kappa, key_inv_norm, log_gamma, lam, gate_weight, gate_bias, lam_max, P_in, m_in, n_in, q,
        T, NT, H=H, K=K, C=C, CENTERED=bool(centered), NORMALIZE=raw_keys, GATE=gate is not None, IEEE=ieee,
    )
    if return_chunk_states:
        return q, final, (P_in, m_in, n_in)
    return q, final

