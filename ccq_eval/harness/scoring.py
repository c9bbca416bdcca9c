"""Scoring for the lm-eval adapter: loglikelihood and loglikelihood_rolling over a carried recurrent
state, one pass per text (successive slices share one cache), with per-token NLLs (`TokenNLL`).
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import torch
from lm_eval.api.instance import Instance
from tqdm import tqdm

from ccq_eval.model.kernels.token_logprob import token_logprob

logger = logging.getLogger(__name__)

# One model call per 32K tokens: each call costs a fixed host-side overhead, while the recurrent state
# keeps activation memory per call small; logits are formed DEFAULT_LOGITS_CHUNK positions at a time.
DEFAULT_CHUNK_SIZE = 32768
DEFAULT_LOGITS_CHUNK = 4096


class TokenNLL(float):
    """Summed log-likelihood of a text (the float lm-eval expects from loglikelihood_rolling)
    that also carries `token_nll`: the NLL of every scored token, in text order.

    `token_nll[i]` is the NLL of the prediction made with i + 1 tokens of model input
    before it (BOS included when the tokenizer has one), which is what position-bucketed
    perplexity needs. Arithmetic on it returns plain floats. Picklable (lm-eval's SQLite
    response cache pickles results).
    """

    token_nll: list[float]

    def __new__(cls, logprob: float, token_nll: Sequence[float]) -> Self:
        values = [float(x) for x in token_nll]
        total = -math.fsum(values)
        logprob = float(logprob)
        if not (math.isclose(logprob, total, rel_tol=1e-9, abs_tol=1e-6)
                or (math.isnan(logprob) and math.isnan(total))):
            raise ValueError(f"TokenNLL: logprob {logprob} is not minus the sum of token_nll ({total})")
        obj = super().__new__(cls, logprob)
        obj.token_nll = values
        return obj

    @classmethod
    def from_token_nll(cls, token_nll: Sequence[float]) -> Self:
        """The logprob is minus their sum by construction, so the check of __new__ is skipped (one
        conversion and one sum over a 20K-token text instead of two: this runs between documents)."""
        values = list(map(float, token_nll))
        obj = super().__new__(cls, -math.fsum(values))
        obj.token_nll = values
        return obj

    def __reduce__(self):
        return (TokenNLL, (float(self), self.token_nll))

    @property
    def n_tokens(self) -> int:
        return len(self.token_nll)


class ScoringMixin:
    """loglikelihood / loglikelihood_rolling of CCQEvalLM (state it uses is set up by its __init__)."""

    # ------------------------------------------------------------------ model calls
    def _forward(self, input_ids: torch.Tensor, cache: Any, logits_to_keep: int) -> tuple[torch.Tensor, Any]:
        """One slice through the model with the carried cache. Returns (logits of the last
        `logits_to_keep` positions, or all when 0 / unsupported, new cache)."""
        features, new_cache = self._forward_features(input_ids, cache, logits_to_keep)
        return self._logits(features), new_cache

    def _forward_features(self, input_ids: torch.Tensor, cache: Any, keep: int,
                          use_cache: bool = True) -> tuple[torch.Tensor, Any]:
        """Like _forward, but for fla models the backbone's hidden states of the last `keep`
        positions instead of logits (turned into logits by `_logits`, a slice at a time).
        use_cache=False: the last slice of a text whose cache nobody reads (no cache returned)."""
        if self._backbone is not None:
            out = self._backbone(input_ids=input_ids, past_key_values=cache, use_cache=use_cache)
            hidden = out[0]
            return (hidden[:, -keep:] if keep else hidden), out.past_key_values
        kwargs: dict[str, Any] = {"use_cache": use_cache}
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        if self._has_logits_to_keep and keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(input_ids=input_ids, **kwargs)
        new_cache = out.get("past_key_values")
        if new_cache is None:
            new_cache = out.get("cache")
        logits = out["logits"]
        if keep:
            logits = logits[:, -keep:]
        return logits, new_cache

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """fp32 (at least) logits from what _forward_features returned."""
        logits = features if self._lm_head is None else self._lm_head(features)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    @torch.no_grad()
    def _run(self, input_ids: torch.Tensor, score_from: int, to_cpu: bool = True,
             keep_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Run [B, T] token rows through the model in slices of chunk_size, carrying the cache.

        Scores the predictions made at positions score_from .. T-2 (position p predicts token
        p + 1). Returns (logprob [B, T-1-score_from] fp32, greedy-match [B, ...] bool, both on CPU
        unless to_cpu=False, fp32 logits at the last position [B, V] for decoding, the cache after
        T tokens, or None with keep_cache=False: scoring alone then skips building the cache of the
        last slice, the layers' state outputs and fla's cache updates). Nothing waits for the GPU
        before the end (no per-slice copies to the host).
        """
        n_rows, total = input_ids.shape
        logprob_parts: list[torch.Tensor] = []
        greedy_parts: list[torch.Tensor] = []
        cache = None
        last_logits = None
        for start in range(0, total, self.chunk_size):
            end = min(start + self.chunk_size, total)
            if cache is None and start > 0:
                raise RuntimeError(f"{type(self.model).__name__} returned no cache with use_cache=True; "
                                   "chunked scoring needs a model that returns past_key_values / cache")
            first_needed = max(start, score_from)
            last_scored = min(end, total - 1)  # the final position predicts nothing
            keep = last_scored - first_needed if last_scored > first_needed else 0
            # Only the slice's scored positions need logits (plus the final position when decoding).
            keep_last = end - first_needed if keep else 1
            features, cache = self._forward_features(input_ids[:, start:end], cache, keep_last,
                                                     use_cache=keep_cache or end < total)
            if end == total:
                last_logits = self._logits(features[:, -1:])[:, -1]
            for a in range(0, keep, self.logits_chunk):
                b = min(a + self.logits_chunk, keep)
                # Logits in the model's dtype; token_logprob does the log-softmax in fp32 (one fused
                # pass on CUDA, fp64 stays fp64).
                scored = features[:, a:b] if self._lm_head is None else self._lm_head(features[:, a:b])
                targets = input_ids[:, first_needed + 1 + a:first_needed + 1 + b]
                logprob, greedy = token_logprob(scored, targets)
                logprob_parts.append(logprob)
                greedy_parts.append(greedy)
                del scored
            del features
        if logprob_parts:
            logprob = torch.cat(logprob_parts, dim=1)
            greedy = torch.cat(greedy_parts, dim=1)
        else:
            logprob = torch.zeros(n_rows, 0, device=input_ids.device)
            greedy = torch.zeros(n_rows, 0, dtype=torch.bool, device=input_ids.device)
        if to_cpu:
            logprob, greedy = logprob.cpu(), greedy.cpu()
        return logprob, greedy, last_logits, cache

    def _score_eagerly(self, input_ids: torch.Tensor, score_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        logprob, greedy, _, _ = self._run(input_ids, score_from, to_cpu=False, keep_cache=False)
        return logprob, greedy

    def _score(self, input_ids: torch.Tensor, score_from: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob, greedy) on the device for positions score_from .. T-2, no cache kept: replayed from
        a CUDA graph (every position scored, then sliced; valid until the next call) where cuda_graphs
        is on and the graphs take this shape, else eagerly."""
        graphed = None if self._graphed_scoring is None else self._graphed_scoring(input_ids)
        if graphed is None:
            return self._score_eagerly(input_ids, score_from)
        logprob, greedy = graphed
        return logprob[:, score_from:], greedy[:, score_from:]

    def _batches(self, lengths: list[int], any_length: bool = False) -> Iterator[list[int]]:
        """Index groups of equal length (longest first), at most batch_size each; with any_length,
        groups of batch_size in order of decreasing length."""
        if any_length:
            order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
            for i in range(0, len(order), self.batch_size):
                yield order[i:i + self.batch_size]
            return
        by_length: dict[int, list[int]] = defaultdict(list)
        for index, length in enumerate(lengths):
            by_length[length].append(index)
        for length in sorted(by_length, reverse=True):
            indices = by_length[length]
            for i in range(0, len(indices), self.batch_size):
                yield indices[i:i + self.batch_size]

    def _tensor(self, rows: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(rows, dtype=torch.long)
        if self._device.type == "cuda":
            # From pinned memory the copy is queued behind the GPU's work instead of waiting for it.
            return ids.pin_memory().to(self._device, non_blocking=True)
        return ids.to(self._device)

    # ------------------------------------------------------------------ lm-eval API
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        prepared: list[tuple[list[int], int]] = []  # (input ids, number of continuation tokens)
        seen: set[int] = set()
        for request in requests:
            first_time = id(request) not in seen
            seen.add(id(request))
            context, continuation = request.args
            if context:
                n_spaces = len(context) - len(context.rstrip())
                if n_spaces:  # keep word-boundary spaces with the continuation, as lm-eval does
                    continuation = context[-n_spaces:] + continuation
                    context = context[:-n_spaces]
                whole = self.tok_encode(context + continuation)
                context_ids = self.tok_encode(context)
                continuation_ids = whole[len(context_ids):]
                prefix = self.prefix
            else:
                context_ids = []
                continuation_ids = self.tok_encode(continuation)
                prefix = self.prefix or [self.eot_token_id]
            budget = self.max_length - len(prefix) - len(continuation_ids)
            context_ids = self._fit(context_ids, budget, self.default_truncation, request.task_name,
                                    f"max_length {self.max_length} minus {len(continuation_ids)} continuation tokens",
                                    count=first_time)
            prepared.append((prefix + context_ids + continuation_ids, len(continuation_ids)))

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        batches = list(self._batches([len(ids) for ids, _ in prepared]))
        for batch in tqdm(batches, desc="ccq loglikelihood", disable=disable_tqdm or self.rank != 0):
            rows = [prepared[i][0] for i in batch]
            total = len(rows[0])
            n_scored = [prepared[i][1] for i in batch]
            score_from = total - 1 - max(n_scored)
            logprob, greedy = (x.cpu() for x in self._score(self._tensor(rows), score_from))
            for row, index in enumerate(batch):
                n = n_scored[row]
                if n == 0:
                    answer = (0.0, True)
                else:
                    answer = (float(logprob[row, -n:].double().sum()), bool(greedy[row, -n:].all()))
                results[index] = answer
                self.cache_hook.add_partial("loglikelihood", requests[index].args, answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[TokenNLL]:
        """Each text scored whole in one recurrent pass. A pipeline keeps the GPU busy: worker threads
        tokenise ahead (tens of ms for a 20K-token text; the fast tokenizers release the GIL), and a
        text's scores are copied back and unpacked while the next text runs."""
        results: list[TokenNLL | None] = [None] * len(requests)
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            encoded = pool.map(self.tok_encode, [request.args[0] for request in requests])
            if self.batch_size == 1:  # in request order, each text as soon as it is tokenised
                batches: Iterator[list[tuple[int, list[int]]]] = (
                    [(i, self.prefix + ids)] for i, ids in enumerate(encoded))
                n_batches = len(requests)
            else:  # equal-length batches need every length first
                rows_all = [self.prefix + ids for ids in encoded]
                grouped = list(self._batches([len(r) for r in rows_all]))
                batches = iter([[(i, rows_all[i]) for i in batch] for batch in grouped])
                n_batches = len(grouped)
            pending = None
            for batch in tqdm(batches, total=n_batches, desc="ccq loglikelihood_rolling",
                              disable=disable_tqdm or self.rank != 0):
                started = self._start_rolling(batch)
                if pending is not None:
                    self._finish_rolling(pending, requests, results)
                pending = started
            if pending is not None:
                self._finish_rolling(pending, requests, results)
        return results  # type: ignore[return-value]

    def _start_rolling(self, batch: list[tuple[int, list[int]]]):
        """Queue the scoring of one batch of rows; returns what _finish_rolling needs."""
        indices, rows = [i for i, _ in batch], [row for _, row in batch]
        longest = max(len(row) for row in rows)
        if longest > self.max_length and not self._warned_rolling_over_length:
            # Rolling scoring is the whole text by definition (no truncation); say so once.
            logger.warning("loglikelihood_rolling: a text of %d tokens exceeds max_length %d; it is scored "
                           "whole in one recurrent pass", longest, self.max_length)
            self._warned_rolling_over_length = True
        if len(rows[0]) < 2:  # nothing to predict
            return indices, torch.zeros(len(rows), 0), None
        logprob, _ = self._score(self._tensor(rows), 0)
        if logprob.device.type != "cuda":
            return indices, logprob.cpu(), None
        host = torch.empty(logprob.shape, dtype=logprob.dtype, pin_memory=True)
        host.copy_(logprob, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return indices, host, copied

    def _finish_rolling(self, started, requests: list[Instance], results: list) -> None:
        indices, logprob, copied = started
        if copied is not None:
            copied.synchronize()  # waits for this batch's copy only, not for work queued after it
        for row, index in enumerate(indices):
            value = TokenNLL.from_token_nll((-logprob[row]).tolist())
            results[index] = value
            self.cache_hook.add_partial("loglikelihood_rolling", requests[index].args, value)
