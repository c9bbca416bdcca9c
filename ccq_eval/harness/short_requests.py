"""Many short scored rows, fast: the loglikelihood requests of multiple-choice tasks (tens of thousands of
rows of a few hundred tokens in the zero-shot suite) and the windows of HFLM's rolling protocol.

A row is token ids whose last `n` tokens are scored (each from the positions before it). Two things make
such rows cheap without changing their numbers beyond rounding:

* Right-padded batches (`padded_batches`): rows of similar length (the shortest at least 1 - MAX_PADDING
  of the longest) share one forward, each padded at its end. The models are causal, so a position's score
  does not depend on the tokens after it: padding at the end changes nothing that is read.
* Shared contexts (`shared_batches`): the requests of one multiple-choice document repeat one context
  before 2-4 continuations. Contexts of similar length are read together once, up to one token short of
  the shortest of them; that state (fla's recurrent state, or a transformer's KV cache) is copied to one
  row per request (the cache's reorder_cache), and each request's row is the rest of its context and its
  continuation, scored from the copied state in one right-padded batch. The state after a prefix is the
  one a full pass computes at that point, so the scores equal scoring each request alone up to the
  rounding of a forward split in two. Models whose forward returns no such cache score whole rows.

Batch rows are what the adapter's BatchSizer allows for the batch's longest row (`rows_for`); on CUDA that
is sized by free memory as generation is, on the CPU's "auto" CPU_SHORT_SCORING_BATCH rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

# A batch takes rows down to (1 - MAX_PADDING) of its longest row's length (contexts: of its longest
# context): at most this share of a batch's positions are padding (or, for contexts, re-read per request).
MAX_PADDING = 0.25

# (logprob of each scored token [n] fp32, whether each is the greedy choice [n] bool), on the CPU.
RowScores = tuple[torch.Tensor, torch.Tensor]


def padded_batches(lengths: list[int], rows_for: Callable[[int], int]) -> list[list[int]]:
    """Index groups of similar length, longest first: each takes rows while it has fewer than rows_for(its
    longest length) and the next row is at least (1 - MAX_PADDING) of that length."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    start = 0
    while start < len(order):
        longest = lengths[order[start]]
        cap = max(1, rows_for(longest))
        end = start + 1
        while end < len(order) and end - start < cap and lengths[order[end]] >= (1 - MAX_PADDING) * longest:
            end += 1
        groups.append(order[start:end])
        start = end
    return groups


def context_groups(rows: list[list[int]], n_scored: list[int]) -> tuple[list[list[int]], list[int]]:
    """(groups of two or more row indices whose rows share their context, the tokens before the scored
    ones, of at least two tokens; the other indices), each in row order."""
    by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
    alone: list[int] = []
    for index, (row, n) in enumerate(zip(rows, n_scored, strict=True)):
        if n > 0 and len(row) - n >= 2:
            by_context[tuple(row[:len(row) - n])].append(index)
        else:
            alone.append(index)
    groups = [members for members in by_context.values() if len(members) > 1]
    alone += [members[0] for members in by_context.values() if len(members) == 1]
    return groups, sorted(alone)


def shared_batches(context_lengths: list[int], group_sizes: list[int], longest_scored: list[int],
                   rows_for: Callable[[int], int]) -> list[list[int]]:
    """Context groups (by index) read together: longest context first, contexts down to (1 - MAX_PADDING)
    of the first one's length, as long as the batch's request rows (the sum of group_sizes) stay within
    rows_for(the first context's length plus the most scored tokens of the batch)."""
    order = sorted(range(len(context_lengths)), key=lambda g: -context_lengths[g])
    batches: list[list[int]] = []
    start = 0
    while start < len(order):
        first = order[start]
        longest, rows, most_scored = context_lengths[first], group_sizes[first], longest_scored[first]
        end = start + 1
        while end < len(order):
            group = order[end]
            scored = max(most_scored, longest_scored[group])
            if (context_lengths[group] < (1 - MAX_PADDING) * longest
                    or rows + group_sizes[group] > max(1, rows_for(longest + scored))):
                break
            rows, most_scored = rows + group_sizes[group], scored
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


def score_padded(score: Callable[[torch.Tensor, int, Any], tuple[torch.Tensor, torch.Tensor]],
                 tensor: Callable[[list[list[int]]], torch.Tensor], rows: list[list[int]], n_scored: list[int],
                 pad_id: int, cache: Any = None) -> list[RowScores]:
    """Each row's scores from one forward of the rows padded at their end with `pad_id`; `cache` (one row
    per row) is the state the rows continue from. score(ids, score_from, cache) -> (logprob, greedy) of
    the positions score_from .. T-2, on the device."""
    longest = max(len(row) for row in rows)
    # Row k's scored tokens sit at positions len - n .. len - 1, each predicted from the position before.
    starts = [len(row) - 1 - n for row, n in zip(rows, n_scored, strict=True)]
    if max(n_scored) == 0 or longest < 2:
        return [(torch.zeros(0), torch.zeros(0, dtype=torch.bool)) for _ in rows]
    score_from = min(starts)
    ids = tensor([row + [pad_id] * (longest - len(row)) for row in rows])
    logprob, greedy = (x.cpu() for x in score(ids, score_from, cache))
    return [(logprob[k, s - score_from:s - score_from + n], greedy[k, s - score_from:s - score_from + n])
            for k, (s, n) in enumerate(zip(starts, n_scored, strict=True))]


def read_contexts(run: Callable[..., tuple[Any, Any, Any, Any]], tensor: Callable[[list[list[int]]], torch.Tensor],
                  contexts: list[list[int]], members: list[list[int]]) -> tuple[Any, int]:
    """The cache after the first (shortest context - 1) tokens of each context, copied to one row per
    member (reorder_cache), and that prefix length; (None, 0) where the model's cache cannot be copied."""
    prefix = min(len(context) for context in contexts) - 1
    ids = tensor([context[:prefix] for context in contexts])
    # Nothing scored (score_from = the last position), the cache kept.
    _, _, _, cache = run(ids, prefix - 1, to_cpu=False, keep_cache=True)
    if cache is None or not hasattr(cache, "reorder_cache"):
        return None, 0
    owners = [c for c, group in enumerate(members) for _ in group]
    cache.reorder_cache(torch.tensor(owners, dtype=torch.long, device=ids.device))
    return cache, prefix


def score_rows(scorer: Any, rows: list[list[int]], n_scored: list[int], *, share: bool, pad_id: int,
               progress: Any = None) -> list[RowScores]:
    """The scores of each row's last n_scored tokens: rows of one context read it once where `share` and
    the model's cache allow, the rest in right-padded batches. `scorer`: the adapter's Scorer (run, score,
    runtime, sizer); `progress`: a tqdm bar, advanced by the rows scored."""
    results: list[RowScores | None] = [None] * len(rows)
    rows_for = scorer.sizer.rows_for(generation=False, short=True)
    groups, alone = context_groups(rows, n_scored) if share else ([], list(range(len(rows))))
    if groups:
        left = _score_shared(scorer, rows, n_scored, groups, rows_for, pad_id, results, progress)
        alone = sorted(alone + left)

    def score(ids: torch.Tensor, score_from: int, _cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return scorer.score(ids, score_from)  # replayed from a CUDA graph where one is captured

    for batch in padded_batches([len(rows[i]) for i in alone], rows_for):
        indices = [alone[i] for i in batch]
        scorer.sizer.record(len(indices))
        scored = score_padded(score, scorer.runtime.tensor, [rows[i] for i in indices],
                              [n_scored[i] for i in indices], pad_id)
        for index, row_scores in zip(indices, scored, strict=True):
            results[index] = row_scores
        if progress is not None:
            progress.update(len(indices))
    return results  # type: ignore[return-value]


def _score_shared(scorer: Any, rows: list[list[int]], n_scored: list[int], groups: list[list[int]],
                  rows_for: Callable[[int], int], pad_id: int, results: list[RowScores | None],
                  progress: Any = None) -> list[int]:
    """Score the context groups' rows into `results` (shared_batches, read_contexts); returns the row
    indices left to score whole (all of them from the first batch on whose cache cannot be copied)."""
    contexts = [rows[group[0]][:len(rows[group[0]]) - n_scored[group[0]]] for group in groups]
    plan = shared_batches([len(context) for context in contexts], [len(group) for group in groups],
                          [max(n_scored[i] for i in group) for group in groups], rows_for)

    def score(ids: torch.Tensor, score_from: int, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logprob, greedy, _, _ = scorer.run(ids, score_from, to_cpu=False, keep_cache=False, cache=cache)
        return logprob, greedy

    for position, batch in enumerate(plan):
        members = [groups[g] for g in batch]
        cache, prefix = read_contexts(scorer.run, scorer.runtime.tensor, [contexts[g] for g in batch], members)
        if cache is None:  # the model's cache cannot be copied: every row left is scored whole
            return [i for later in plan[position:] for g in later for i in groups[g]]
        flat = [i for group in members for i in group]
        scorer.sizer.record(len(flat))
        scored = score_padded(score, scorer.runtime.tensor, [rows[i][prefix:] for i in flat],
                              [n_scored[i] for i in flat], pad_id, cache)
        for index, row_scores in zip(flat, scored, strict=True):
            results[index] = row_scores
        if progress is not None:
            progress.update(len(flat))
    return []
