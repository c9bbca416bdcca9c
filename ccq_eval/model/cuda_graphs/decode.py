"""One-token decode steps of an fla causal LM replayed from a CUDA graph (CUDA only).

Why: an eager one-token step of a many-layer fla model is host-bound (Python, per-layer bookkeeping,
some hundred kernel launches) while its GPU work is tiny. A captured graph replays the same kernels
with one launch.

How: the recurrent cache after prefill is deep-copied into static buffers; one step is captured as
backbone -> LM head -> copy of every new state tensor back into the buffer it was read from (fla's
Cache.update replaces state tensors; conv states are updated in place), so each replay reads the
state the previous replay wrote. Kernels are warmed up (triton compiled and autotuned) on a throwaway
copy first: autotuning cannot run inside a capture. During capture nothing executes, so the buffers
still hold the prefill state when decoding starts. A later prefill of the same layout is decoded by
the same graph: `load` copies its states into those buffers (CCQEvalLM keeps a graph per batch size).

The state buffers the graph reads are held by this object for its lifetime: once CCQ's new P, m, n
replace them in the cache, nothing else keeps them alive, and their memory must not be reused between
replays. tests/model/test_graphed_decode.py (marked gpu) ties graphed to eager decoding, text and
logits. CCQEvalLM uses it by default for recurrent fla models on CUDA (cuda_graphs="auto").
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a cache state, in a fixed traversal order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in value for t in _tensors(value[key])]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def state_tensors(cache: Any) -> list[torch.Tensor]:
    """The state tensors of every layer of an fla Cache, in a fixed order."""
    return [t for layer in cache.layers for t in _tensors(layer.state)]


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """target <- source for every pair, as one multi-tensor kernel per dtype (torch._foreach_copy_),
    not one memcpy per tensor. Why: captured, each copy_ is a memcpy node, and a replay's idle time
    grows with the memcpy nodes more than with the kernels."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources, strict=True):
        group = groups.setdefault((target.dtype, source.dtype, target.device), ([], []))
        group[0].append(target)
        group[1].append(source)
    for group_targets, group_sources in groups.values():
        torch._foreach_copy_(group_targets, group_sources)


class GraphedDecodeStep:
    """step(tokens [B]) -> fp32 logits [B, V] of the next position, advancing the captured state."""

    def __init__(self, backbone: torch.nn.Module, lm_head: torch.nn.Module, cache: Any, batch: int,
                 warmup_steps: int = 2):
        device = next(backbone.parameters()).device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self._ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._cache = copy.deepcopy(cache)
        # Held for the graph's lifetime: once a captured step has replaced a state tensor in the cache
        # (CCQ's P, m, n always are), nothing else references the buffer the graph reads and writes,
        # and freed memory would be handed to other tensors between replays.
        self._buffers = state_tensors(self._cache)

        def step(step_cache):
            hidden = backbone(input_ids=self._ids, past_key_values=step_cache, use_cache=True)[0]
            logits = lm_head(hidden[:, -1])
            return logits.to(torch.promote_types(logits.dtype, torch.float32))

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            scratch = copy.deepcopy(cache)
            for _ in range(warmup_steps):
                step(scratch)
        torch.cuda.current_stream(device).wait_stream(side)
        del scratch

        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._logits = step(self._cache)
            written = state_tensors(self._cache)
            if len(written) != len(self._buffers):
                raise RuntimeError("the cache changed structure during a decode step; cannot graph it")
            replaced = [(target, source) for source, target in zip(written, self._buffers, strict=True)
                        if source.data_ptr() != target.data_ptr()]
            _copy_all([target for target, _ in replaced], [source for _, source in replaced])

    def matches(self, cache: Any) -> bool:
        """Whether `cache` has the layout of the one this graph was captured from (the same state
        tensors' shapes, dtypes and devices), so that `load` can start it from there."""
        return self._same_layout(state_tensors(cache))

    def _same_layout(self, states: list[torch.Tensor]) -> bool:
        return len(states) == len(self._buffers) and all(
            a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            for a, b in zip(states, self._buffers, strict=True))

    def load(self, cache: Any) -> None:
        """Decode from `cache` next (another prefill's, of this layout: see `matches`): its states are
        copied into the buffers the graph reads. The graph's work does not depend on the prompt, only
        on the states, so this is the same as capturing anew, without the warm-up and capture (which
        cost as much as dozens of replays)."""
        states = state_tensors(cache)
        if not self._same_layout(states):
            raise ValueError("GraphedDecodeStep.load: the cache's state tensors differ in shape, dtype or "
                             "device from the captured ones; capture a new graph for it")
        _copy_all(self._buffers, states)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self._ids.copy_(tokens.view(-1, 1))
        self._graph.replay()
        return self._logits.clone()
