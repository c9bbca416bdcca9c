"""Fused Triton kernels for the forward of the CCQ read of order 1 (the default on CUDA for head dims
128 and 256; CCQ_EVAL_CCQ_KERNEL=unfused switches them off, see ccq.fused_kernel_enabled).

The unfused path (`ccq._ccq_chunk_kernel`) spends tens of kernel launches per layer (the decayed sums
m and n, fla's chunk_simple_gla with its preparation kernels, the polynomial), and on a fast GPU that
host-side cost, not arithmetic, bounds it. Here the whole read is four launches of three kernels:

1. `_ccq_chunk_states_kernel`, run twice around a scan: the sums P = sum w kappa kappa^T, m and n,
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

`ccq_decode` holds the one-token step and `ccq_backward` the backward, which reuses these chunk states
and the scan kernel. No [T, K, K] tensor is formed: P_in holds one K x K matrix per chunk, in the
input dtype like fla's chunk states (fp32 when the inputs are fp32). Sums over keys (n, m, the
polynomial) are fp32.

Kernels run on CUDA; with TRITON_INTERPRET=1 (set before this module is imported) they run on CPU
tensors, which is how the CPU tests check them against `ccq.ccq_read_reference`. Measurements of
each design choice: benchmarks/README.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ccq_eval.model.kernels.triton_device import launches_on_input_device

CHUNK = 64


# Few candidates on purpose: each compiles on the first call of a shape.
_LOCAL_CONFIGS = [triton.Config({"BK": bk, "BV": bk}, num_warps=warps, num_stages=2)
                  for bk in (32, 64) for warps in (4, 8)]
SCAN_BLOCK = 256  # P entries per scan program: K = 128 gives 64 programs per head
SCAN_STEPS = 16  # slots loaded at once by the scan (segments in the forward, chunks in the backward)
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


class _FirstConfig:
    """Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) cannot time candidates: use the first
    (a test may pick another from `configs`)."""

    def __init__(self, configs, key):
        self.configs = configs
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


@triton.jit
def _chunk_rows(log_gamma, i_b, i_h, c, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """The C positions of chunk c for batch i_b, head i_h: pos (0..C-1), t, the mask t < T, the log
    decays g (0 past T: padded steps change nothing), b their cumulative sum from the chunk start, and
    each row's offset into [B, T, H, K] tensors."""
    pos = tl.arange(0, C)
    t = c * C + pos
    t_ok = t < T
    g = tl.load(log_gamma + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0).to(tl.float32)
    b = tl.cumsum(g, 0)
    base = ((i_b * T + t) * H + i_h).to(tl.int64) * K
    return pos, t, t_ok, g, b, base


@triton.jit
def _in_chunk_decays(pos, t_ok, b):
    """D[t, i] = w_{i,t} = exp(b_t - b_i) for i <= t inside the chunk (0 above the diagonal and for
    columns past T)."""
    causal = (pos[:, None] >= pos[None, :]) & t_ok[None, :]
    return tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))


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


# The chunk states: grid (K / BR row blocks, segments, B * H). Each program holds its BR x K rows of
# the state in fp32 registers (64 x 256 at d_k = 256: 64 registers per thread at 8 warps) and walks its
# segment's chunks, one tensor-core product per chunk. Segments make the walk parallel over time: a
# first run of the kernel sums each segment (from its last chunk back), the state scan turns those
# sums into the states entering the segments, and a second run walks the segments again in order from
# those states, writing the state entering every chunk (so the K x K states are written once).
# Candidates: 4 warps (the fastest measured, though the second pass spills a little at d_k = 256),
# 8 warps with 1 or 2 stages, and 16 warps (the second pass then fits in 128 registers per thread).
_STATE_CONFIGS = [triton.Config({}, num_warps=warps, num_stages=stages)
                  for warps, stages in ((4, 2), (8, 2), (8, 1), (16, 2))]
STATE_ROWS = 64  # rows per program: the M of a Hopper tensor-core product (<= every head dim)


@triton.jit
def _chunk_terms(kappa, key_inv_norm, log_gamma, i_b, i_h, c, rows, T, H: tl.constexpr, K: tl.constexpr,
                 C: tl.constexpr, NORMALIZE: tl.constexpr):
    """Chunk c's terms of the state sums: its total log decay G_c, to_end_i = exp(G_c - b_i), the
    weights of kappa_i in m (scale) and of k_i k_i^T in P (outer_scale), its K-wide keys as loaded and
    their `rows` columns in fp32."""
    _pos, t, t_ok, g, b, base = _chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    g_chunk = tl.sum(g, 0)
    to_end = tl.where(t_ok, tl.exp(g_chunk - b), 0.0)  # decay from step i to the end of the chunk
    keys = tl.load(kappa + base[:, None] + tl.arange(0, K)[None, :], mask=t_ok[:, None], other=0.0)
    row_keys = tl.load(kappa + base[:, None] + rows[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    scale = to_end
    outer_scale = to_end
    if NORMALIZE:  # raw keys in: kappa = k / max(||k||, 1e-6), so kappa kappa^T = k k^T / ||k||^2
        # (both norms on the row side: the K-wide keys go to the product as loaded)
        inv_norm = tl.load(key_inv_norm + (i_b * T + t) * H + i_h, mask=t_ok, other=0.0)
        scale = to_end * inv_norm
        outer_scale = scale * inv_norm
    return g_chunk, to_end, scale, outer_scale, keys, row_keys


@triton.jit
def _add_outer(S, row_keys, weights, keys, IEEE: tl.constexpr):
    """S + (row_keys * weights)^T @ keys on the tensor cores (in fp32 with IEEE)."""
    if IEEE:
        return tl.dot(tl.trans(row_keys * weights[:, None]), keys.to(tl.float32), S, input_precision="ieee")
    return tl.dot(tl.trans((row_keys * weights[:, None]).to(keys.dtype)), keys, S)


@_tuned(configs=_STATE_CONFIGS, key=["H", "K", "C", "BR", "NORMALIZE", "IEEE", "STATES"])
@triton.jit
def _ccq_chunk_states_kernel(
    kappa, key_inv_norm, log_gamma, seg_P, seg_m, seg_n, seg_decay, P_in, m_in, n_in,
    T, NT, NSEG, SEG,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, IEEE: tl.constexpr, STATES: tl.constexpr,
):
    """The decayed sums P = sum w kappa kappa^T, m = sum w kappa, n = sum w over segment s (chunks
    s * SEG .. min((s + 1) * SEG, NT) - 1), with w the decay from a key's step to the segment's end.
    STATES=False: the segment's own sums, from zero, to slot s + 1 of seg_P / seg_m / seg_n, and its
    total log decay to seg_decay. STATES=True: from slot s (the state entering the segment, after the
    scan), chunk by chunk, state <- exp(G_c) state + local_c with local_c = sum_{i in c} exp(G_c - b_i)
    kappa_i kappa_i^T and G_c the chunk's total log decay; the state entering each chunk c goes to slot
    c of P_in / m_in / n_in, and after chunk NT - 1 to slot NT. Row block 0's programs keep n."""
    i_r, s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_r * BR + tl.arange(0, BR)
    tile = rows[:, None] * K + tl.arange(0, K)[None, :]
    c_end = tl.minimum((s + 1) * SEG, NT)
    if STATES:
        entering = (i_bh * (NSEG + 1) + s).to(tl.int64)
        S = tl.load(seg_P + entering * K * K + tile)
        m = tl.load(seg_m + entering * K + rows)
        n = tl.load(seg_n + entering)
        for c in range(s * SEG, c_end):
            slot = (i_bh * (NT + 1) + c).to(tl.int64)
            tl.store(P_in + slot * K * K + tile, S.to(P_in.dtype.element_ty))
            tl.store(m_in + slot * K + rows, m)
            if i_r == 0:
                tl.store(n_in + slot, n)
            g_chunk, to_end, scale, outer_scale, keys, row_keys = _chunk_terms(
                kappa, key_inv_norm, log_gamma, i_b, i_h, c, rows, T, H, K, C, NORMALIZE)
            decay = tl.exp(g_chunk)
            S = _add_outer(S * decay, row_keys, outer_scale, keys, IEEE)
            m = m * decay + tl.sum(row_keys * scale[:, None], 0)
            n = n * decay + tl.sum(to_end, 0)
        if c_end == NT:  # the last segment: the state after the last chunk
            slot = (i_bh * (NT + 1) + NT).to(tl.int64)
            tl.store(P_in + slot * K * K + tile, S.to(P_in.dtype.element_ty))
            tl.store(m_in + slot * K + rows, m)
            if i_r == 0:
                tl.store(n_in + slot, n)
    else:
        # The chunks from the last back, each term weighted by its decay to the segment's end
        # (exp(log_total) * to_end <= 1): the sum is never rescaled, so the tensor-core products
        # accumulate in place (ptxas: an asynchronous product with one pending; a rescaled sum, as in
        # the other branch, waits for each product).
        S = tl.zeros([BR, K], dtype=tl.float32)
        m = tl.zeros([BR], dtype=tl.float32)
        n = tl.sum(tl.zeros([1], dtype=tl.float32), 0)
        log_total = tl.sum(tl.zeros([1], dtype=tl.float32), 0)  # from the current chunk's end
        for j in range(0, c_end - s * SEG):
            g_chunk, to_end, scale, outer_scale, keys, row_keys = _chunk_terms(
                kappa, key_inv_norm, log_gamma, i_b, i_h, c_end - 1 - j, rows, T, H, K, C, NORMALIZE)
            later = tl.exp(log_total)  # decay from this chunk's end to the segment's end
            S = _add_outer(S, row_keys, outer_scale * later, keys, IEEE)
            m += tl.sum(row_keys * (scale * later)[:, None], 0)
            n += tl.sum(to_end * later, 0)
            log_total += g_chunk
        total = (i_bh * (NSEG + 1) + s + 1).to(tl.int64)
        tl.store(seg_P + total * K * K + tile, S)
        tl.store(seg_m + total * K + rows, m)
        if i_r == 0:
            tl.store(seg_n + total, n)
            tl.store(seg_decay + i_bh * NSEG + s, log_total)


@triton.jit
def _group_weights(decay_row, c0, NT, STEPS: tl.constexpr):
    """For the slots c0 .. c0 + STEPS - 1 of the scan (those past NT masked: decay 1, nothing added):
    x_j = a_j x_{j-1} + b_j unrolled over the group is x_j = exp(G_j) x_{c0-1} + sum_{i<=j} W[j, i] b_i,
    with G the cumulative log decay inside the group and W[j, i] = exp(G_j - G_i) (<= 1: no overflow)."""
    steps = tl.arange(0, STEPS)
    cs = c0 + steps
    c_ok = cs <= NT
    G = tl.cumsum(tl.load(decay_row + cs - 1, mask=c_ok, other=0.0), 0)
    lower = steps[:, None] >= steps[None, :]
    W = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
    return cs, c_ok, tl.exp(G), W


@triton.jit
def _scan_slots(slots, base, width, idx, ok, acc, decay_row, NT, STEPS: tl.constexpr):
    """The in-place scan of one element block `idx` (mask `ok`, at least 16 wide) over slots 1..NT:
    slot c becomes decay_{c-1} * slot c-1 + slot c, starting from `acc` (slot 0's value). STEPS slots
    are loaded at a time and combined by one small matrix product, so the serial chain waits for one
    load per STEPS chunks, not per chunk (one chunk per step was latency-bound). Returns the last state."""
    steps = tl.arange(0, STEPS)
    for c0 in range(1, NT + 1, STEPS):
        cs, c_ok, scale, W = _group_weights(decay_row, c0, NT, STEPS)
        where = base + cs[:, None].to(tl.int64) * width + idx[None, :]
        mask = c_ok[:, None] & ok[None, :]
        local = tl.load(slots + where, mask=mask, other=0.0).to(tl.float32)
        states = scale[:, None] * acc[None, :] + tl.dot(W, local, input_precision="ieee")
        tl.store(slots + where, states.to(slots.dtype.element_ty), mask=mask)
        acc = tl.sum(tl.where(steps[:, None] == STEPS - 1, states, 0.0), 0)
    return acc


@triton.jit
def _scan_counts(slots, base, acc, decay_row, NT, STEPS: tl.constexpr):
    """_scan_slots for one scalar per slot (n): acc and the result are 0-d."""
    steps = tl.arange(0, STEPS)
    for c0 in range(1, NT + 1, STEPS):
        cs, c_ok, scale, W = _group_weights(decay_row, c0, NT, STEPS)
        local = tl.load(slots + base + cs, mask=c_ok, other=0.0)
        states = scale * acc + tl.sum(W * local[None, :], 1)
        tl.store(slots + base + cs, states, mask=c_ok)
        acc = tl.sum(tl.where(steps == STEPS - 1, states, 0.0), 0)
    return acc


# Not autotuned: the scan works in place, and the autotuner's repeated timing runs would accumulate
# the sums again and again.
@triton.jit
def _ccq_state_scan_kernel(
    P_in, m_in, n_in, chunk_decay, P0, m0, n0, P_final, m_final, n_final,
    NT,
    K: tl.constexpr, BLOCK: tl.constexpr, KB: tl.constexpr, STEPS: tl.constexpr,
    HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    """In place over slots 0..NT: slot c becomes the state entering step c (slot NT: after the last),
    state_c = exp(G_{c-1}) state_{c-1} + local_{c-1}, a step being a segment of the forward's state
    kernel or a chunk of the backward's anti-causal sums. Elementwise; programs 0..cdiv(K*K, BLOCK)-1 take
    BLOCK entries of P each, the last one m (KB >= K entries) and n."""
    i_blk, i_bh = tl.program_id(0), tl.program_id(1)
    n_blocks = tl.cdiv(K * K, BLOCK)
    decay_row = chunk_decay + i_bh * NT
    if i_blk < n_blocks:
        idx = i_blk * BLOCK + tl.arange(0, BLOCK)
        ok = idx < K * K
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_INITIAL:
            acc += tl.load(P0 + i_bh * K * K + idx, mask=ok, other=0.0)
        base = i_bh.to(tl.int64) * (NT + 1) * K * K
        tl.store(P_in + base + idx, acc.to(P_in.dtype.element_ty), mask=ok)
        acc = _scan_slots(P_in, base, K * K, idx, ok, acc, decay_row, NT, STEPS)
        if STORE_FINAL:
            tl.store(P_final + i_bh * K * K + idx, acc, mask=ok)
    else:
        cols = tl.arange(0, KB)
        col_ok = cols < K
        m = tl.zeros([KB], dtype=tl.float32)
        n = tl.sum(tl.zeros([1], dtype=tl.float32), 0)
        if HAS_INITIAL:
            m += tl.load(m0 + i_bh * K + cols, mask=col_ok, other=0.0)
            n += tl.load(n0 + i_bh)
        base = i_bh.to(tl.int64) * (NT + 1)
        tl.store(m_in + base * K + cols, m, mask=col_ok)
        tl.store(n_in + base, n)
        m = _scan_slots(m_in, base * K, K, cols, col_ok, m, decay_row, NT, STEPS)
        n = _scan_counts(n_in, base, n, decay_row, NT, STEPS)
        if STORE_FINAL:
            tl.store(m_final + i_bh * K + cols, m, mask=col_ok)
            tl.store(n_final + i_bh, n)


def _scan_states(P_in, m_in, n_in, chunk_decay, NT, K, initial=None, final=None):
    """Launches _ccq_state_scan_kernel over B*H rows (initial / final: (P, m, n) or None)."""
    dummy = n_in  # stands in for absent optional pointers (never read or written)
    _ccq_state_scan_kernel[(triton.cdiv(K * K, SCAN_BLOCK) + 1, P_in.shape[0])](
        P_in, m_in, n_in, chunk_decay,
        *(initial if initial is not None else (dummy, dummy, dummy)),
        *(final if final is not None else (dummy, dummy, dummy)),
        NT, K=K, BLOCK=SCAN_BLOCK, KB=triton.next_power_of_2(K), STEPS=SCAN_STEPS,
        HAS_INITIAL=initial is not None, STORE_FINAL=final is not None, num_warps=4, num_stages=2,
    )


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


@_tuned(configs=_READ_CONFIGS, key=["H", "K", "C", "CENTERED", "NORMALIZE", "GATE", "IEEE"])
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
    pos, t, t_ok, _g, b, base = _chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    row_ok = t_ok[:, None]
    from_start = tl.exp(b)
    D = _in_chunk_decays(pos, t_ok, b)

    # Per chunk, once: the scores r_t . kappa_i and the per-position sums over the head dim.
    scores = tl.zeros([C, C], dtype=tl.float32)
    r_dot_m_in = tl.zeros([C], dtype=tl.float32)
    gate_logit = tl.zeros([C], dtype=tl.float32)  # a_h . r_t (GATE: lambda from the query)
    if WHOLE:  # the chunk's K-wide rows of r and kappa held once, every product one dot over K
        ks = tl.arange(0, K)
        r_all = tl.load(r + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        kap_all = tl.load(kappa + base[:, None] + ks[None, :], mask=row_ok, other=0.0)
        if IEEE:
            scores = tl.dot(r_all.to(tl.float32), tl.trans(kap_all.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(r_all, tl.trans(kap_all.to(r_all.dtype)))
        r_dot_m_in = tl.sum(r_all.to(tl.float32) * tl.load(m_in + state * K + ks)[None, :], 1)
        if GATE:
            gate_logit = tl.sum(r_all.to(tl.float32) * tl.load(gate_weight + i_h * K + ks)[None, :], 1)
    else:
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


def _segment_chunks(NT: int, programs_per_segment: int, device) -> int:
    """Chunks per segment of _ccq_chunk_states_kernel: segments enough for about four programs per
    SM for one batch row, `programs_per_segment` being a row's programs per segment (longer segments
    walk more chunks in series; shorter ones only add entering states to scan). Not from the batch
    size: a row's states then come out the same, bit for bit, whichever rows share its call (batches
    of equal-length texts, a data-parallel split of them), and a batch of B rows has B times the
    programs of one, each walking as far. Off CUDA (the interpreter), as for a GPU of 8 SMs, so that
    small test shapes get several segments of several chunks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return triton.cdiv(NT, max(1, 4 * sms // programs_per_segment))


def _kernel_gate(gate, H: int, K: int, device):
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
        gate_weight, gate_bias, lam_max = _kernel_gate(gate, H, K, r.device)
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
    SEG = segment_chunks or _segment_chunks(NT, K // STATE_ROWS * H, r.device)
    NSEG = triton.cdiv(NT, SEG)
    # Segment slot s: the sums over segment s - 1, which the scan turns into the state entering s.
    seg_P = torch.empty(B * H, NSEG + 1, K, K, device=r.device, dtype=torch.float32)
    seg_m = torch.empty(B * H, NSEG + 1, K, device=r.device, dtype=torch.float32)
    seg_n = torch.empty(B * H, NSEG + 1, device=r.device, dtype=torch.float32)
    seg_decay = torch.empty(B * H, NSEG, device=r.device, dtype=torch.float32)
    for states in (False, True):
        _ccq_chunk_states_kernel[(K // STATE_ROWS, NSEG, B * H)](
            kappa, key_inv_norm, log_gamma, seg_P, seg_m, seg_n, seg_decay, P_in, m_in, n_in,
            T, NT, NSEG, SEG, H=H, K=K, C=C, BR=STATE_ROWS, NORMALIZE=raw_keys, IEEE=ieee, STATES=states)
        if not states:
            _scan_states(seg_P, seg_m, seg_n, seg_decay, NSEG, K, init, final)
    q = torch.empty_like(r)
    read_grid = lambda meta: (meta["SPLIT"], NT, B * H)  # noqa: E731
    _ccq_read_kernel[read_grid](
        r, kappa, key_inv_norm, log_gamma, lam, gate_weight, gate_bias, lam_max, P_in, m_in, n_in, q,
        T, NT, H=H, K=K, C=C, CENTERED=bool(centered), NORMALIZE=raw_keys, GATE=gate is not None, IEEE=ieee,
    )
    if return_chunk_states:
        return q, final, (P_in, m_in, n_in)
    return q, final

