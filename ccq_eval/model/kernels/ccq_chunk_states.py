"""The chunk layout and chunk states of the fused CCQ read of order 1, which `ccq_forward` and
`ccq_backward` share.

The forward's stages 1 and 2 (see `ccq_forward`): `ccq_chunk_states_kernel` walks the sums
P = sum w kappa kappa^T, m = sum w kappa and n = sum w chunk by chunk inside segments of the sequence
that run in parallel, and `_ccq_state_scan_kernel` turns the per-segment sums into the states entering
the segments; a second run of the state kernel then writes the state entering every chunk. The
backward runs the same scan over its anti-causal sums. Also here: the chunk size, each chunk's rows
and in-chunk decays as every kernel reads them, and the autotuner wrapper that takes the first
candidate under Triton's interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CHUNK = 64

SCAN_BLOCK = 256  # P entries per scan program: K = 128 gives 64 programs per head
SCAN_STEPS = 16  # slots loaded at once by the scan (segments in the forward, chunks in the backward)


class FirstConfig:
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


# The decorator every ccq kernel is tuned with (the forward, backward and state kernels).
autotuned = FirstConfig if os.environ.get("TRITON_INTERPRET") == "1" else triton.autotune


@triton.jit
def chunk_rows(log_gamma, i_b, i_h, c, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
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
def in_chunk_decays(pos, t_ok, b):
    """D[t, i] = w_{i,t} = exp(b_t - b_i) for i <= t inside the chunk (0 above the diagonal and for
    columns past T)."""
    causal = (pos[:, None] >= pos[None, :]) & t_ok[None, :]
    return tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))


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
    _pos, t, t_ok, g, b, base = chunk_rows(log_gamma, i_b, i_h, c, T, H, K, C)
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


@autotuned(configs=_STATE_CONFIGS, key=["H", "K", "C", "BR", "NORMALIZE", "IEEE", "STATES"])
@triton.jit
def ccq_chunk_states_kernel(
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


def scan_states(P_in, m_in, n_in, chunk_decay, NT, K, initial=None, final=None):
    """Launches _ccq_state_scan_kernel over B*H rows (initial / final: (P, m, n) or None)."""
    dummy = n_in  # stands in for absent optional pointers (never read or written)
    _ccq_state_scan_kernel[(triton.cdiv(K * K, SCAN_BLOCK) + 1, P_in.shape[0])](
        P_in, m_in, n_in, chunk_decay,
        *(initial if initial is not None else (dummy, dummy, dummy)),
        *(final if final is not None else (dummy, dummy, dummy)),
        NT, K=K, BLOCK=SCAN_BLOCK, KB=triton.next_power_of_2(K), STEPS=SCAN_STEPS,
        HAS_INITIAL=initial is not None, STORE_FINAL=final is not None, num_warps=4, num_stages=2,
    )


def chunks_per_segment(NT: int, programs_per_segment: int, device) -> int:
    """Chunks per segment of ccq_chunk_states_kernel: segments enough for about four programs per
    SM for one batch row, `programs_per_segment` being a row's programs per segment (longer segments
    walk more chunks in series; shorter ones only add entering states to scan). Not from the batch
    size: a row's states then come out the same, bit for bit, whichever rows share its call (batches
    of equal-length texts, a data-parallel split of them), and a batch of B rows has B times the
    programs of one, each walking as far. Off CUDA (the interpreter), as for a GPU of 8 SMs, so that
    small test shapes get several segments of several chunks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return triton.cdiv(NT, max(1, 4 * sms // programs_per_segment))

