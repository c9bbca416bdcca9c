"""Fused Triton kernels for the CCQ read of order 1 (the default), forward and backward, for CUDA.

The default CCQ read on CUDA for head dims 128 and 256 (CCQ_EVAL_CCQ_KERNEL=unfused
switches it off; see ccq.fused_kernel_enabled); checked on the H200 by the GPU tests and
scripts/fused_smoke.py (benchmarks/README.md).

The unfused kernel path (`ccq._ccq_chunk_kernel`) spends about 60 kernel launches per layer (the
decayed sums m and n, fla's chunk_simple_gla with its own preparation kernels, and the polynomial):
on the H200 that host-side cost, not arithmetic, made CCQ 1.6-2x slower than the backbone. Here the
whole read is four launches of three kernels:

1. `_ccq_chunk_states_kernel`, run twice around a scan: the sums P = sum w kappa kappa^T, m and n
   walked chunk by chunk (one tensor-core product per chunk, the state in registers) inside segments
   of the sequence that run in parallel. The first run sums each segment from zero;
2. `_ccq_state_scan_kernel` turns those sums into the state entering every segment (SCAN_STEPS
   segments loaded at once); the second run walks the segments again from their entering states and
   writes the state entering every chunk, P_in[c] = sum_{i < start(c)} w kappa_i kappa_i^T, m_in[c],
   n_in[c], once. (Before, every chunk's own sum was written, then scanned in place over all chunks:
   the K x K states went through memory three times, 445 us per Gated DeltaNet layer at 20K tokens on
   the H200. A single sequential kernel, as fla's chunk_fwd_h, was latency-bound: 88 us per layer at
   4K tokens, five times that at 20K.)
3. `_ccq_read_kernel`: every chunk in parallel; the in-chunk cumulative decay, the intra-chunk part
   (r kappa^T masked by the decays) @ kappa, the carried part r @ P_in[c], the counts n_t, means mu_t,
   the gate product and q~ = r - lambda Sigma r, written once in the input dtype. The chunk's scores
   r kappa^T are formed once per program, which then walks its columns of q~ (at d_k = 256 on the
   H200: 380 us per layer at 20K, against 649 us when each column block recomputed them; 253 us with
   4 warps and 4 stages, see _READ_CONFIGS). Folding
   the read into the second state pass, so that the chunk states are never written, was 2.6-3.3x
   slower: that walk is serial, and the read lengthened each of its steps (benchmarks/README.md,
   "Fused v5.1").

`_ccq_decode_kernel` is the one-token step of the recurrence (state update and q~ in one launch).
The backward (see the comment above `_ccq_bwd_query_kernel`) reuses the forward's chunk states and
its scan kernel for the anti-causal sums. No [T, K, K] tensor is formed: P_in holds one K x K matrix
per chunk, in the input dtype like fla's chunk states (fp32 when the inputs are fp32). Sums over keys
(n, m, the polynomial) are fp32.

Kernels run on CUDA; with TRITON_INTERPRET=1 (set before this module is imported) they run on CPU
tensors, which is how the CPU tests check them against `ccq.ccq_read_reference`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ccq_eval.triton_device import launches_on_input_device

CHUNK = 64


# Few candidates on purpose: each compiles on the first call of a shape.
_LOCAL_CONFIGS = [triton.Config({"BK": bk, "BV": bk}, num_warps=warps, num_stages=2)
                  for bk in (32, 64) for warps in (4, 8)]
SCAN_BLOCK = 256  # P entries per scan program: K = 128 gives 64 programs per head
SCAN_STEPS = 16  # slots loaded at once by the scan (segments in the forward, chunks in the backward)
# The read kernel: SPLIT programs per chunk share the K columns of q~; each computes the chunk's
# scores r kappa^T once and then walks its columns in BV-wide blocks. (One program per BV columns,
# as before, recomputed the scores K / BV times.) WHOLE: the chunk's K-wide rows of r and kappa are
# loaded once and every product is one dot over the whole head dim (at d_k = 256: 255 registers and
# 124 KB of shared memory, 1 program per SM); otherwise the products walk K in BK-wide tiles (121
# registers, 32 KB: 2 programs per SM). The tiled kernel with 4 warps and 3 or 4 stages is the fastest
# by kernel time on the H200 (benchmarks/tune_ccq.py, 2026-12-02, profiler, T = 20480, bf16): at
# d_k = 256 (Gated DeltaNet-340M) 273 / 253 us against 353 us for the whole-K 8-warp kernel the
# autotuner picked before; at d_k = 128 (GLA-340M) 78 / 76 us against 100 us. With 4 warps the
# whole-K kernel spills, so it keeps 8.
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
    of the forward, for its state and read kernels: computed inside them, the norms of a chunk's keys
    took a cross-warp reduction per chunk and program, about 100 us of the state kernel's first pass
    and 70 us of its second (d_k = 256, Gated DeltaNet-340M at 20K tokens on the H200,
    benchmarks/results/h200/fused-v5/kernels-87b2092.txt)."""
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
# those states, writing the state entering every chunk. (Computing every chunk's own sum in parallel
# and scanning those, as before, wrote the K x K states twice and read them once more: at d_k = 256 on
# the H200, 205 + 240 us per Gated DeltaNet layer at 20K tokens, 1.2-2.1 TB/s.)
# On the H200 (Gated DeltaNet-340M, 20K tokens) 4 warps were fastest, though at d_k = 256 the second
# pass spills about 250 bytes per thread with them (ptxas, sm_90), then 8 warps with 1 or 2 stages;
# 3 stages were never faster. 16 warps: the second pass at d_k = 256 fits in 128 registers per
# thread, twice the warps per SM of 8 warps at 235 (with it, fc97e50, both passes still took 152 us).
_STATE_CONFIGS = [triton.Config({}, num_warps=warps, num_stages=stages)
                  for warps, stages in ((4, 2), (8, 2), (8, 1), (16, 2))]
STATE_ROWS = 64  # rows per program: the M of a Hopper tensor-core product (<= every head dim)


@triton.jit
def _chunk_terms(kappa, key_inv_norm, log_gamma, i_b, i_h, c, rows, T, H: tl.constexpr, K: tl.constexpr,
                 C: tl.constexpr, NORMALIZE: tl.constexpr):
    """Chunk c's terms of the state sums: its total log decay G_c, to_end_i = exp(G_c - b_i), the
    weights of kappa_i in m (scale) and of k_i k_i^T in P (outer_scale), its K-wide keys as loaded and
    their `rows` columns in fp32."""
    pos, t, t_ok, g, b, base = _chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
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
        # the other branch, waits for each product). On the H200 this pass took as long as before
        # (151.6 us vs 151 at Gated DeltaNet's 20K forward): the wait was not what bounds it.
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
# the sums again and again (on the H200 that gave NaNs).
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
    pos, t, t_ok, g, b, base = _chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
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
        r_v = tl.load(r + base[:, None] + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
        q = r_v - lam_t[:, None] * sigma_r
        tl.store(q_out + base[:, None] + cols[None, :], q.to(q_out.dtype.element_ty), mask=col_mask)


FORWARD_HEAD_DIMS = (64, 128, 256)


def supports_head_dim(K: int) -> bool:
    """Head dims checked on the H200: 128 (GLA-340M) and 256 (Gated DeltaNet-340M). With 32 and 64
    the read kernel hit an illegal memory access in bf16 (cause not found); they take the unfused path,
    and so do wider heads (the state kernel keeps K-wide rows in registers)."""
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
# (8 warps). With BK = 64 the query kernel spilled 1-2 KB per thread (ptxas sm_90, triton 3.9), with 32
# about 250 bytes, with 16 nothing. A separate reduction tile (16 x 32, 32 x 32, 16 x 64 besides 16 x 16)
# was tried: autotuning the bf16 key kernel of GLA-340M (K = 128, 4K tokens) with those candidates hit
# an illegal memory access on the H200 (triton 3.6, commit 91aa55e), though the fp32 candidate test
# passed; equal tiles of 16 and 32 train both 340M shapes in bf16.
_BWD_CONFIGS = [triton.Config({"BK": bk}, num_warps=8, num_stages=2) for bk in (16, 32)]


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


@_tuned(configs=_BWD_CONFIGS, key=["H", "K", "C", "CENTERED", "NORMALIZE", "GATE", "IEEE"])
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
    pos, t, t_ok, g, b, base = _chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    from_start = tl.exp(b)
    D = _in_chunk_decays(pos, t_ok, b)
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
    out = (i_b * T + t) * H + i_h
    tl.store(dn_out + out, dn, mask=t_ok)
    tl.store(dlam_out + out, dlam, mask=t_ok)
    tl.debug_barrier()  # dPu of this chunk, just written by other threads of this program, is read below

    # Pass 3: dr = dq + dalpha mu + P_t dPu_t (+ d logit a with GATE).
    ED = E * D
    for j0 in range(0, K, BK):
        js = j0 + tl.arange(0, BK)
        carried = _rows_times_state(dPu_out, base, row_ok, P_in + state * K * K, js, C, K, BK, IEEE)
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


@_tuned(configs=_LOCAL_CONFIGS, key=["H", "K", "C", "IEEE"])
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
    pos, t, t_ok, g, b, base = _chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
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


@_tuned(configs=_BWD_CONFIGS, key=["H", "K", "C", "CENTERED", "NORMALIZE", "IEEE"])
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
    pos, t, t_ok, g, b, base = _chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
    to_end = tl.where(t_ok, tl.exp(tl.sum(g, 0) - b), 0.0)
    D = _in_chunk_decays(pos, t_ok, b)
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
        gate_weight, gate_bias, lam_max = _kernel_gate(gate, H, K, r.device)
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
    _scan_states(Q, g_acc, h_acc, decay_rev, NT, K)
    dkappa = torch.empty(B, T, H, K, **f32) if raw_keys else torch.empty_like(kappa)
    dk = torch.empty_like(kappa) if raw_keys else dkappa
    dc = torch.empty(B, T, H, **f32)
    _ccq_bwd_key_kernel[(NT, B * H)](
        r, kappa, log_gamma, dPu, dm, dn, Q, g_acc, h_acc, dkappa, dk, dc, T, NT,
        H=H, K=K, C=C, CENTERED=bool(centered), NORMALIZE=raw_keys, IEEE=ieee,
    )
    # Sums over t >= j along time, time made the innermost axis: torch scans an outer axis with one
    # thread per inner element (B * H of them), which took 500 us per layer at 4K tokens on the H200
    # (the Gated DeltaNet training profile at 250850d).
    dlog_gamma = dc.transpose(1, 2).flip(-1).cumsum(-1).flip(-1).transpose(1, 2)
    if gate is not None:
        return dr, dk, dlog_gamma, dlam, dweight_parts.sum((0, 1))
    return dr, dk, dlog_gamma, dlam


# ------------------------------------------------------------------------------------------ decode
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
