"""Scoring forwards of a recurrent fla model replayed from CUDA graphs (CUDA only; the adapter default).

Why: on a fast GPU the eager forward of a mid-size model is bound by host-side work (Python and some
thousand kernel launches per long text), not by the GPU. A captured graph replays the same kernels
with one launch, so scoring runs at the GPU's pace and the host is free to tokenise ahead.

How: one graph per (rows, padded length). A text of T tokens is scored in a graph for
`padded_length(T)` >= T positions, the extra positions filled with token 0: the models are causal, so
the scores of the first T positions do not depend on them (padding: under 1/8 of the positions or 64
tokens; nearby lengths share a graph). A shape is captured when it comes a second time, for at
most MAX_GRAPHS shapes; the rest run eagerly. Kernels are warmed up (triton compiled and autotuned) on
a side stream first, since autotuning cannot run inside a capture. The graphs share one memory pool
and are replayed one at a time. The results are views into the graph's output buffers, valid until
the next call (the adapter copies them to the host in stream order before that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

MAX_GRAPHS = 8  # shapes captured at most; later shapes run eagerly


def padded_length(length: int) -> int:
    """The graph length for a text of `length` tokens: a multiple of 1/16 of the power of two above it
    (at least 64), so padding adds fewer than max(64, length / 8) positions and each octave has at most
    16 shapes."""
    step = max(64, 1 << max(0, (length - 1).bit_length() - 4))
    return -(-length // step) * step


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # the static input rows [B, padded T]
    logprob: torch.Tensor  # [B, padded T - 1] fp32
    greedy: torch.Tensor  # [B, padded T - 1] bool


class GraphedScoring:
    """score(ids [B, T] on the device) -> (logprob [B, T - 1] fp32, greedy [B, T - 1] bool) replayed
    from a graph, or None where this shape is not replayed (the caller scores eagerly): the
    log-probability of each next token and whether it is the greedy choice, as `run(ids)` computes
    them eagerly (run: ids -> (logprob, greedy) for every position, no cache). Padded lengths above
    max_length are not captured."""

    def __init__(self, run: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 max_length: int, max_graphs: int = MAX_GRAPHS, warmup_calls: int = 2):
        if torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self._run = run
        self._device = torch.device(device)
        self._max_length = max_length
        self._max_graphs = max_graphs
        self._warmup_calls = warmup_calls
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._seen: dict[tuple[int, int], int] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows, length = ids.shape
        if length < 2:
            raise ValueError(f"scoring needs at least 2 tokens per row, got {length}")
        key = (rows, padded_length(length))
        if key[1] > self._max_length:
            return None
        entry = self._graphs.get(key)
        if entry is None:
            # A shape is captured the second time it comes (a capture costs about three forwards), while
            # there is room: texts of scattered lengths run eagerly instead of capturing again and again.
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] < 2 or len(self._graphs) >= self._max_graphs:
                return None
            entry = self._graphs[key] = self._capture(*key)
        entry.ids[:, :length].copy_(ids)
        entry.ids[:, length:].zero_()  # seen only by later positions (causal): deterministic padding
        entry.graph.replay()
        return entry.logprob[:, :length - 1], entry.greedy[:, :length - 1]

    def _capture(self, rows: int, length: int) -> _Captured:
        ids = torch.zeros(rows, length, dtype=torch.long, device=self._device)
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self._warmup_calls):
                self._run(ids)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logprob, greedy = self._run(ids)
        except RuntimeError as error:  # e.g. a host synchronisation inside the model's forward
            raise RuntimeError(f"capturing the scoring forward ({rows} x {length} tokens) in a CUDA graph "
                               f"failed: {error}. Score without CUDA graphs (cuda_graphs=False; "
                               "ccq-eval run --no-cuda-graphs)") from error
        return _Captured(graph, ids, logprob, greedy)
