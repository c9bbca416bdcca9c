"""Rows per batch for the lm-eval adapter: a fixed number, or on the CUDA fast path ("auto") as many as
the free GPU memory holds for the batch's longest row.

Auto sizing (`BatchSizer` with fixed=None): once per model, one eager forward of PROBE_TOKENS tokens
through the model's body measures its peak memory per token (with ROW_COST_MARGIN on top) and the
recurrent state of one row; the LM head with the log-probabilities on those hidden states measures the
memory per position whose logits are formed (`measure_row_cost`). Each scoring or generation call then
reads the free memory once (`free_memory_bytes`), and each batch, formed from requests sorted longest
first, takes the rows that `auto_batch_size` allows for its longest row (one row where it says none fits).
A row is counted as one forward slice of its tokens (min(tokens, chunk_size)), the logits formed at once
(scoring: up to logits_chunk positions of the slice; generation: the last position's, in the model's
dtype and in fp32) and its recurrent state, twice for generation (the eager cache and the CUDA graph's
copy of it). Counting the logits by the positions that form them, not by every token of the slice, is what
lets long generation prompts batch: a prefill forms logits for its last position only. Where a generation
batch's prompts are prefilled one at a time (a recurrent model's default), the batch holds one forward
slice, not one per row: its rows are counted by their state and logits, and prompts of one length that a
single forward would take together are split into forwards that fit (`prefill_rows`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Auto batches are powers of two up to this: CUDA graphs are captured per batch size (decode) and per
# (rows, length) shape (scoring), so at most seven full-batch sizes exist, and a 64-row decode step of a
# 340M-1.3B model already does enough work per weight read that more rows gain little.
AUTO_BATCH_CAP = 64
# Prompts decoded together by a recurrent model on the CPU when the batch size is "auto": each decode step
# costs mostly per-call overhead there, so decoding prompts together is several times faster, and a
# recurrent row's greedy text does not depend on its neighbours. Long texts are scored one row at a time.
CPU_GENERATION_BATCH = 16
# Rows of one loglikelihood batch of short rows (at most SHORT_ROW_TOKENS tokens: multiple-choice requests)
# on the CPU when the batch size is "auto": a forward of a small model on a short row costs mostly per-call
# overhead, and right-padded rows of similar length share one forward (short_requests.py).
CPU_SHORT_SCORING_BATCH = 16
SHORT_ROW_TOKENS = 1024
# Share of the free memory that auto batches plan to fill: the rest absorbs allocator fragmentation,
# CUDA graph pools and the per-batch tensors the row cost leaves out (outputs, kernels' workspaces).
MEMORY_SHARE = 0.8
# Peak bytes per token of the probe forward are scaled by this: kernels pick other tiles at other lengths.
ROW_COST_MARGIN = 1.25
# Tokens of the probe forward: long enough that fixed buffers are a small part of its peak, short enough
# to cost a few milliseconds.
PROBE_TOKENS = 1024


def auto_batch_size(free_bytes: float, tokens_per_row: int, bytes_per_token: float, cap: int,
                    fixed_bytes_per_row: float = 0.0, one_forward: bool = False) -> int:
    """The largest power of two <= cap such that that many rows of `tokens_per_row` tokens at
    `bytes_per_token` each, plus `fixed_bytes_per_row` per row (state, logits), fit in `free_bytes`.
    one_forward: the rows' forwards run one after another (prompts prefilled alone), so the batch holds
    one row's forward and every row's fixed bytes.

    Raises MemoryError when not even one row fits (the run would fail at its first forward anyway; the
    message says why and what to change)."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    forward_bytes = tokens_per_row * bytes_per_token
    row_bytes = forward_bytes + fixed_bytes_per_row
    if one_forward:
        room = free_bytes - forward_bytes
        fitting = int(room // fixed_bytes_per_row) if fixed_bytes_per_row > 0 else (cap if room >= 0 else 0)
    else:
        fitting = int(free_bytes // row_bytes) if row_bytes > 0 else cap
    if fitting < 1:
        raise MemoryError(f"one row of {tokens_per_row} tokens needs about {row_bytes / 2**30:.2f} GiB "
                          f"({bytes_per_token:.0f} bytes per token, {fixed_bytes_per_row:.0f} bytes of "
                          f"state and logits) but {free_bytes / 2**30:.2f} GiB are free for batches; pass a smaller "
                          "chunk_size or free GPU memory")
    rows = min(fitting, cap)
    return 1 << (rows.bit_length() - 1)


@dataclass(frozen=True)
class RowCost:
    """Device memory of one row: `bytes_per_token` per token of a forward slice through the model's body,
    the bytes of its recurrent state (`state_bytes`), and `head_bytes_per_position` per position whose
    logits are formed at once (the LM head and the log-probabilities)."""

    bytes_per_token: float
    state_bytes: float
    head_bytes_per_position: float = 0.0


def free_memory_bytes(device: torch.device) -> int:
    """Bytes a batch can still allocate on the CUDA `device`: what the driver reports free plus what
    PyTorch's caching allocator holds without using it."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def cache_state_bytes(cache: Any) -> int:
    """Bytes of the tensors in a model cache (an fla Cache's layer states, or nested dicts / sequences)."""
    if isinstance(cache, torch.Tensor):
        return cache.numel() * cache.element_size()
    if isinstance(cache, dict):
        return sum(cache_state_bytes(value) for value in cache.values())
    if isinstance(cache, (list, tuple)):
        return sum(cache_state_bytes(value) for value in cache)
    if hasattr(cache, "layers"):
        return sum(cache_state_bytes(getattr(layer, "state", None)) for layer in cache.layers)
    return 0


def measure_row_cost(body: Callable[[torch.Tensor], tuple[torch.Tensor, Any]], device: torch.device,
                     tokens: int, token_id: int,
                     head: Callable[[torch.Tensor, torch.Tensor], int] | None = None) -> RowCost:
    """RowCost of a model on the CUDA `device` from one eager forward of one row of `tokens` tokens
    (`body`: ids [1, tokens] -> (hidden states of every position, the cache after them)): the peak memory
    it allocated above what was in use before, per token and scaled by ROW_COST_MARGIN, and the bytes of
    the cache it returned; then, with `head` ((hidden states, ids) -> the positions whose logits it
    formed), the peak above what was held after the body, per position and with the same margin. Resets
    the device's peak-memory statistics."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.full((1, tokens), token_id, dtype=torch.long, device=device)
    hidden, cache = body(ids)
    torch.cuda.synchronize(device)
    body_peak = torch.cuda.max_memory_allocated(device) - before
    state = cache_state_bytes(cache)
    del cache
    head_per_position = 0.0
    if head is not None:
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        positions = head(hidden, ids)
        torch.cuda.synchronize(device)
        head_per_position = (torch.cuda.max_memory_allocated(device) - held) * ROW_COST_MARGIN / max(positions, 1)
    del hidden
    return RowCost(bytes_per_token=body_peak * ROW_COST_MARGIN / tokens, state_bytes=float(state),
                   head_bytes_per_position=head_per_position)


class BatchSizer:
    """Rows per batch of the adapter's scorer and generator, and the sizes that ran.

    fixed: that many rows at most (an explicit batch size, or 1 off the fast path); None: auto sizing
    from free memory (see the module docstring) with `measure` (-> RowCost, called once, on first need)
    and `free_memory` (-> bytes, read at the start of each call). With `fixed`, measure and free_memory
    (optional) serve `fits_now` only. logits_chunk: the positions whose
    logits scoring forms at once (None: a whole slice). generation_rows: with `fixed`, the rows of a
    generation batch instead (CPU_GENERATION_BATCH on the CPU's "auto"). short_rows: with `fixed`, the rows
    of a loglikelihood batch whose rows have at most SHORT_ROW_TOKENS tokens (CPU_SHORT_SCORING_BATCH on the
    CPU's "auto").
    """

    def __init__(self, fixed: int | None, *, chunk_size: int, measure: Callable[[], RowCost] | None = None,
                 free_memory: Callable[[], int] | None = None, cap: int = AUTO_BATCH_CAP,
                 generation_rows: int | None = None, logits_chunk: int | None = None,
                 short_rows: int | None = None) -> None:
        if fixed is None and (measure is None or free_memory is None):
            raise ValueError("auto batch sizing needs measure= and free_memory=")
        if (measure is None) != (free_memory is None):
            raise ValueError("give measure= and free_memory= together")
        self.fixed = fixed
        self.generation_rows = generation_rows if fixed is not None else None
        self.short_rows = short_rows if fixed is not None else None
        self.chunk_size = chunk_size
        self.logits_chunk = logits_chunk
        self.cap = cap
        self._measure = measure
        self._free_memory = free_memory
        self._row_cost: RowCost | None = None
        self.used: Counter[int] = Counter()  # rows of a batch -> batches run with that many

    @property
    def auto(self) -> bool:
        return self.fixed is None

    @property
    def max_rows(self) -> int:
        """The most rows one batch may take (scoring or generation)."""
        return max(self.scoring_max_rows, self.generation_rows or 0, self.short_rows or 0)

    @property
    def scoring_max_rows(self) -> int:
        """The most rows one scoring batch may take."""
        return self.cap if self.fixed is None else self.fixed

    @property
    def row_cost(self) -> RowCost:
        """The measured RowCost (auto only; measured on first use)."""
        if self._row_cost is None:
            assert self._measure is not None
            self._row_cost = self._measure()
        return self._row_cost

    def rows_for(self, generation: bool, short: bool = False, prefill_alone: bool = False) -> Callable[[int], int]:
        """tokens of a batch's longest row -> rows of that batch, for scoring or (generation=True)
        generation; short=True: loglikelihood rows, which take short_rows where they are short;
        prefill_alone: generation batches whose prompts are prefilled one at a time (one forward slice
        held beside every row's state). Auto sizing reads the free memory now, once for the batches of
        one call."""
        if self.fixed is not None:
            fixed = self.generation_rows if generation and self.generation_rows else self.fixed
            if short and not generation and self.short_rows:
                short_rows = self.short_rows
                return lambda tokens: short_rows if tokens <= SHORT_ROW_TOKENS else fixed
            return lambda tokens: fixed
        cost = self.row_cost  # measured before the free memory is read: the probe's blocks are then free
        free = MEMORY_SHARE * self._free_memory()  # type: ignore[misc]

        def rows(tokens: int) -> int:
            slice_tokens, fixed_bytes = self._row_parts(tokens, generation)
            try:
                return auto_batch_size(free, slice_tokens, cost.bytes_per_token, self.cap, fixed_bytes,
                                       one_forward=generation and prefill_alone)
            except MemoryError as err:
                # The row cost is an upper bound (margins on a probe), so one row may still fit: run it as a
                # fixed batch of 1 would, rather than refuse what batch_size=1 could do.
                logger.warning("auto batch size: %s; running one row at a time", err)
                return 1

        return rows

    def fits_now(self, lengths: list[int], generation: bool, prefill_alone: bool = False) -> bool:
        """Whether one more batch of rows of these token lengths fits in MEMORY_SHARE of the memory free
        now, beside what is allocated already (a batch that is decoding): the rows counted as auto sizing
        counts them (prefill_alone as in rows_for). False without measure and free_memory."""
        if self._measure is None or self._free_memory is None:
            return False
        planned = self.planned_batch_bytes(lengths, generation, prefill_alone)  # measures first
        return planned <= MEMORY_SHARE * self._free_memory()

    def planned_batch_bytes(self, lengths: list[int], generation: bool, prefill_alone: bool = False) -> float:
        """The device memory auto sizing counts for a batch of rows of these token lengths (needs
        `measure`): every row's, or with prefill_alone (generation) one forward slice, the longest, and
        every row's state and logits."""
        if not (generation and prefill_alone):
            return sum(self.planned_row_bytes(tokens, generation) for tokens in lengths)
        parts = [self._row_parts(tokens, generation) for tokens in lengths]
        return (max(slice_tokens for slice_tokens, _ in parts) * self.row_cost.bytes_per_token
                + sum(fixed_bytes for _, fixed_bytes in parts))

    def planned_row_bytes(self, tokens: int, generation: bool) -> float:
        """The device memory auto sizing counts for one row of `tokens` tokens (needs `measure`)."""
        slice_tokens, fixed_bytes = self._row_parts(tokens, generation)
        return slice_tokens * self.row_cost.bytes_per_token + fixed_bytes

    def prefill_rows(self, tokens: int, rows: int) -> int:
        """How many of a generation batch's `rows` prompts, all of `tokens` tokens, one forward prefills
        together where the batch was sized with prefill_alone: with a fixed batch size all of them, with
        auto sizing as many as MEMORY_SHARE of the memory free now holds beside every row's state and
        logits (at least one)."""
        if self.fixed is not None:
            return rows
        slice_tokens, fixed_bytes = self._row_parts(tokens, generation=True)
        room = MEMORY_SHARE * self._free_memory() - rows * fixed_bytes  # type: ignore[misc]
        slice_bytes = slice_tokens * self.row_cost.bytes_per_token
        together = int(room // slice_bytes) if slice_bytes > 0 else rows
        return max(1, min(rows, together))

    def _row_parts(self, tokens: int, generation: bool) -> tuple[int, float]:
        """(tokens of the row's forward slice, the bytes it costs beside them: state and logits)."""
        cost = self.row_cost
        slice_tokens = min(tokens, self.chunk_size)
        # Generation forms one position's logits per row at a time (the prefill's last, then each decode
        # step's), in the model's dtype and in fp32: three positions' worth of the head's cost. Scoring forms
        # up to logits_chunk positions of a slice at once.
        head_positions = 3 if generation else min(slice_tokens, self.logits_chunk or slice_tokens)
        state = cost.state_bytes * (2 if generation else 1)
        return slice_tokens, state + head_positions * cost.head_bytes_per_position

    def record(self, rows: int) -> None:
        """Count one batch of `rows` rows that ran."""
        self.used[rows] += 1
