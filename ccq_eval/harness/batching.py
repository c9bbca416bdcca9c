"""Rows per batch for the lm-eval adapter: a fixed number, or on the CUDA fast path ("auto") as many as
the free GPU memory holds for the batch's longest row.

Auto sizing (`BatchSizer` with fixed=None): once per model, one eager forward of PROBE_TOKENS tokens
measures the peak memory per token of a forward (with ROW_COST_MARGIN on top) and the recurrent state of
one row (`measure_row_cost`). Each scoring or generation call then reads the free memory once
(`free_memory_bytes`), and each batch, formed from requests sorted longest first, takes the rows that
`auto_batch_size` allows for its longest row (one row where it says none fits). A row is counted as one
forward slice of its tokens (min(tokens, chunk_size)) plus its recurrent state, twice for generation (the
eager cache and the CUDA graph's copy of it). This is an upper bound: generation prefills rows of unequal
length one at a time, and logits are formed logits_chunk positions at a time, so long rows cost less per
token than measured.
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
# recurrent row's greedy text does not depend on its neighbours. Scoring on the CPU stays one row at a time.
CPU_GENERATION_BATCH = 16
# Share of the free memory that auto batches plan to fill: the rest absorbs allocator fragmentation,
# CUDA graph pools and the per-batch tensors the row cost leaves out (logits of the last position, outputs).
MEMORY_SHARE = 0.8
# Peak bytes per token of the probe forward are scaled by this: kernels pick other tiles at other lengths.
ROW_COST_MARGIN = 1.25
# Tokens of the probe forward: long enough that fixed buffers are a small part of its peak, short enough
# to cost a few milliseconds.
PROBE_TOKENS = 1024


def auto_batch_size(free_bytes: float, tokens_per_row: int, bytes_per_token: float, cap: int,
                    state_bytes_per_row: float = 0.0) -> int:
    """The largest power of two <= cap such that that many rows of `tokens_per_row` tokens at
    `bytes_per_token` each, plus `state_bytes_per_row` per row, fit in `free_bytes`.

    Raises MemoryError when not even one row fits (the run would fail at its first forward anyway; the
    message says why and what to change)."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    row_bytes = tokens_per_row * bytes_per_token + state_bytes_per_row
    fitting = int(free_bytes // row_bytes) if row_bytes > 0 else cap
    if fitting < 1:
        raise MemoryError(f"one row of {tokens_per_row} tokens needs about {row_bytes / 2**30:.2f} GiB "
                          f"({bytes_per_token:.0f} bytes per token, {state_bytes_per_row:.0f} bytes of "
                          f"state) but {free_bytes / 2**30:.2f} GiB are free for batches; pass a smaller "
                          "chunk_size or free GPU memory")
    rows = min(fitting, cap)
    return 1 << (rows.bit_length() - 1)


@dataclass(frozen=True)
class RowCost:
    """Device memory of one row: `bytes_per_token` per token of a forward slice, and the bytes of its
    recurrent state (`state_bytes`)."""

    bytes_per_token: float
    state_bytes: float


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


def measure_row_cost(run: Callable[[torch.Tensor], Any], device: torch.device, tokens: int,
                     token_id: int) -> RowCost:
    """RowCost of a model on the CUDA `device` from one eager forward of one row of `tokens` tokens
    (`run`: ids [1, tokens] -> the cache after them): the peak memory it allocated above what was in use
    before, per token and scaled by ROW_COST_MARGIN, and the bytes of the cache it returned. Resets the
    device's peak-memory statistics."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.full((1, tokens), token_id, dtype=torch.long, device=device)
    cache = run(ids)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    state = cache_state_bytes(cache)
    del cache
    return RowCost(bytes_per_token=peak * ROW_COST_MARGIN / tokens, state_bytes=float(state))


class BatchSizer:
    """Rows per batch of the adapter's scorer and generator, and the sizes that ran.

    fixed: that many rows at most (an explicit batch size, or 1 off the fast path); None: auto sizing
    from free memory (see the module docstring) with `measure` (-> RowCost, called once, on first need)
    and `free_memory` (-> bytes, read at the start of each call). generation_rows: with `fixed`, the rows
    of a generation batch instead (CPU_GENERATION_BATCH on the CPU's "auto").
    """

    def __init__(self, fixed: int | None, *, chunk_size: int, measure: Callable[[], RowCost] | None = None,
                 free_memory: Callable[[], int] | None = None, cap: int = AUTO_BATCH_CAP,
                 generation_rows: int | None = None) -> None:
        if fixed is None and (measure is None or free_memory is None):
            raise ValueError("auto batch sizing needs measure= and free_memory=")
        self.fixed = fixed
        self.generation_rows = generation_rows if fixed is not None else None
        self.chunk_size = chunk_size
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
        return max(self.scoring_max_rows, self.generation_rows or 0)

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

    def rows_for(self, generation: bool) -> Callable[[int], int]:
        """tokens of a batch's longest row -> rows of that batch, for scoring or (generation=True)
        generation; auto sizing reads the free memory now, once for the batches of one call."""
        if self.fixed is not None:
            fixed = self.generation_rows if generation and self.generation_rows else self.fixed
            return lambda tokens: fixed
        cost = self.row_cost
        free = MEMORY_SHARE * self._free_memory()  # type: ignore[misc]
        state = cost.state_bytes * (2 if generation else 1)

        def rows(tokens: int) -> int:
            try:
                return auto_batch_size(free, min(tokens, self.chunk_size), cost.bytes_per_token, self.cap,
                                       state)
            except MemoryError as err:
                # The row cost is an upper bound (margins on a probe), so one row may still fit: run it as a
                # fixed batch of 1 would, rather than refuse what batch_size=1 could do.
                logger.warning("auto batch size: %s; running one row at a time", err)
                return 1

        return rows

    def record(self, rows: int) -> None:
        """Count one batch of `rows` rows that ran."""
        self.used[rows] += 1
