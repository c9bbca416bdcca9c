"""Scoring for the lm-eval adapter (`Scorer`): loglikelihood and loglikelihood_rolling over a carried
recurrent state, one pass per text (successive slices share one cache), with per-token NLLs (`TokenNLL`);
or, for the tasks whose published numbers come from lm-eval's HFLM (the zero-shot suite's wikitext),
HFLM's rolling windows, each read afresh.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import CacheHook
from tqdm import tqdm

from ccq_eval.errors import UserError
from ccq_eval.harness import short_requests
from ccq_eval.harness.batching import BatchSizer
from ccq_eval.harness.model_runtime import ModelRuntime
from ccq_eval.harness.tokens import TokenCodec, ahead_on_threads, on_threads
from ccq_eval.harness.truncation import Truncator
from ccq_eval.harness.zeroshot import HFLM_ROLLING_TASKS, rolling_protocol
from ccq_eval.model.kernels.token_logprob import token_logprob

logger = logging.getLogger(__name__)

# One model call per 32K tokens: each call costs a fixed host-side overhead, while the recurrent state
# keeps activation memory per call small; logits are formed DEFAULT_LOGITS_CHUNK positions at a time.
DEFAULT_CHUNK_SIZE = 32768
DEFAULT_LOGITS_CHUNK = 4096
# HFLM's max_length when neither the model config nor the tokenizer names one (HFLM._DEFAULT_MAX_LENGTH):
# the window of the HFLM rolling protocol then.
HFLM_DEFAULT_WINDOW = 2048


class NonFiniteOutputError(UserError, RuntimeError):
    """The model gave NaN or infinite numbers where a unit needs finite ones (a log-likelihood while scoring,
    logits while generating): its answers would be arbitrary (an argmax over NaN picks the first choice), so
    the unit fails and nothing of it is stored, instead of being stored as a score."""


def non_finite_message(what: str, where: str = "") -> str:
    """One line: the model gave NaN or infinite `what` (`where`: which task and request), so the unit failed,
    and what to look at."""
    return (f"the model gave NaN or infinite {what}{f' ({where})' if where else ''}, so its answers mean "
            "nothing and the unit failed: look for NaN / inf weights in the checkpoint, or use a smaller "
            "--ccq-attach lambda")


def check_finite_loglikelihoods(requests: Sequence[Instance], answers: Sequence[tuple[float, bool]]) -> None:
    """NonFiniteOutputError naming the task and the first document whose log-likelihood is NaN or infinite,
    and how many of the requests are; nothing when every answer is finite."""
    bad = [i for i, (logprob, _) in enumerate(answers) if not math.isfinite(logprob)]
    if not bad:
        return
    first = requests[bad[0]]
    tasks = sorted({str(requests[i].task_name) for i in bad})
    where = (f"task {', '.join(tasks)}: {answers[bad[0]][0]} for doc {first.doc_id}, non-finite in {len(bad)} of "
             f"the {len(requests)} loglikelihood requests scored together")
    raise NonFiniteOutputError(non_finite_message("log-likelihoods", where))


class TokenNLL(float):
    """Summed log-likelihood of a text (the float lm-eval expects from loglikelihood_rolling)
    that also carries `token_nll`: the NLL of every scored token, in text order.

    `token_nll[i]` is the NLL of the prediction made with i + 1 tokens of model input
    before it (the prefix included: Scorer.carry_prefix), which is what position-bucketed
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
    def from_token_nll(cls, token_nll: list[float]) -> Self:
        """From a list of floats (what Tensor.tolist gives), kept as it is: the logprob is minus their
        sum by construction, so the conversion and check of __new__ are skipped (this runs between
        documents, one pass over a 20K-token text instead of three)."""
        obj = super().__new__(cls, -math.fsum(token_nll))
        obj.token_nll = token_nll
        return obj

    def __reduce__(self):
        return (TokenNLL, (float(self), self.token_nll))

    @property
    def n_tokens(self) -> int:
        return len(self.token_nll)


def batches(lengths: list[int], batch_size: int | Callable[[int], int],
            any_length: bool = False) -> Iterator[list[int]]:
    """Index groups of equal length (longest first), at most batch_size each; with any_length,
    groups in order of decreasing length. batch_size may be a function of the group's longest length
    (BatchSizer.rows_for): each group then takes as many rows as that gives for its first (longest) row."""
    rows_for = batch_size if callable(batch_size) else (lambda _length: batch_size)
    if any_length:
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        i = 0
        while i < len(order):
            size = rows_for(lengths[order[i]])
            yield order[i:i + size]
            i += size
        return
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, length in enumerate(lengths):
        by_length[length].append(index)
    for length in sorted(by_length, reverse=True):
        indices = by_length[length]
        size = rows_for(length)
        for i in range(0, len(indices), size):
            yield indices[i:i + size]


class Scorer:
    """loglikelihood / loglikelihood_rolling of the adapter: token rows through `runtime` in slices of
    `chunk_size` tokens with one carried cache, logits formed `logits_chunk` positions at a time.

    A batch takes as many rows as `sizer` allows for its longest row. Whole texts (loglikelihood_rolling's
    one-pass protocol) batch only with texts of equal token length: the state after a text must not have
    read padding. Rows that are scored up to their end (loglikelihood requests, HFLM's windows) are
    right-padded to batch rows of similar length, and requests with one context read it once
    (short_requests.py). With `cuda_graphs`, a forward that fits one slice and starts from no cache is
    replayed from a CUDA graph (ccq_eval.model.cuda_graphs.score). Contexts of `loglikelihood` are fitted
    by `truncator` under its default policy. rolling_windows, window_tokens: the rolling protocol
    (zeroshot.rolling_protocol) and HFLM's window; share_contexts: whether contexts are read once.
    """

    def __init__(self, runtime: ModelRuntime, codec: TokenCodec, truncator: Truncator, *, chunk_size: int,
                 logits_chunk: int, sizer: BatchSizer, cuda_graphs: bool, rolling_windows: str | None = None,
                 window_tokens: int = HFLM_DEFAULT_WINDOW, share_contexts: bool = True) -> None:
        self.runtime = runtime
        self.codec = codec
        self.truncator = truncator
        self.chunk_size = chunk_size
        self.logits_chunk = logits_chunk
        self.sizer = sizer
        self.graphed = None
        if cuda_graphs:
            from ccq_eval.model.cuda_graphs.score import GraphedScoring

            # Graphs of at most one slice: a longer text's cache would be built inside the capture.
            self.graphed = GraphedScoring(self.score_eagerly, runtime.device, chunk_size)
        self._warned_rolling_over_length = False
        rolling_protocol(None, rolling_windows)  # checks the value
        self.rolling_windows = rolling_windows
        self.window_tokens = window_tokens
        self.share_contexts = share_contexts
        # Task -> the protocol that scored its loglikelihood_rolling requests (this process).
        self.rolling_protocols: dict[str, str] = {}

    @property
    def pad_id(self) -> int:
        """The token right-padded rows end with (never read: padding follows every scored position)."""
        return self.codec.eot_token_id or 0

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, score_from: int, to_cpu: bool = True,
            keep_cache: bool = True, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Run [B, T] token rows through the model in slices of chunk_size, carrying the cache (`cache`: the
        state of B rows the tokens continue from; None: they start the text).

        Scores the predictions made at positions score_from .. T-2 (position p predicts token
        p + 1). Returns (logprob [B, T-1-score_from] fp32, greedy-match [B, ...] bool, both on CPU
        unless to_cpu=False, fp32 logits at the last position [B, V] for decoding, the cache after
        T tokens, or None with keep_cache=False: scoring alone then skips building the cache of the
        last slice, the layers' state outputs and fla's cache updates). Nothing waits for the GPU
        before the end (no per-slice copies to the host).
        """
        runtime = self.runtime
        n_rows, total = input_ids.shape
        logprob_parts: list[torch.Tensor] = []
        greedy_parts: list[torch.Tensor] = []
        last_logits = None
        for start in range(0, total, self.chunk_size):
            end = min(start + self.chunk_size, total)
            if cache is None and start > 0:
                raise RuntimeError(f"{runtime.name} returned no cache with use_cache=True; "
                                   "chunked scoring needs a model that returns past_key_values / cache")
            first_needed = max(start, score_from)
            last_scored = min(end, total - 1)  # the final position predicts nothing
            keep = last_scored - first_needed if last_scored > first_needed else 0
            # Only the slice's scored positions need logits (plus the final position when decoding).
            keep_last = end - first_needed if keep else 1
            features, cache = runtime.forward_features(input_ids[:, start:end], cache, keep_last,
                                                       use_cache=keep_cache or end < total)
            if end == total:
                last_logits = runtime.logits(features[:, -1:])[:, -1]
            for a in range(0, keep, self.logits_chunk):
                b = min(a + self.logits_chunk, keep)
                # Logits in the model's dtype; token_logprob does the log-softmax in fp32 (one fused
                # pass on CUDA, fp64 stays fp64).
                scored = runtime.head(features[:, a:b])
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

    def score_eagerly(self, input_ids: torch.Tensor, score_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        logprob, greedy, _, _ = self.run(input_ids, score_from, to_cpu=False, keep_cache=False)
        return logprob, greedy

    def score(self, input_ids: torch.Tensor, score_from: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob, greedy) on the device for positions score_from .. T-2, no cache kept: replayed from
        a CUDA graph (every position scored, then sliced; valid until the next call) where cuda_graphs
        is on and the graphs take this shape, else eagerly."""
        graphed = None if self.graphed is None else self.graphed(input_ids)
        if graphed is None:
            return self.score_eagerly(input_ids, score_from)
        logprob, greedy = graphed
        return logprob[:, score_from:], greedy[:, score_from:]

    def _prepare_loglikelihood(self, requests: list[Instance]) -> list[tuple[list[int], int]]:
        """(input ids, number of continuation tokens) of each (context, continuation) request, the
        context fitted into what max_length leaves under the truncator's default policy. "left" is lm-eval
        HFLM's cut: the row (prefix, context, continuation) keeps its last max_length + 1 tokens, of which the
        model reads max_length (the last token predicts nothing), so the context loses its first tokens
        and, past that, the prefix. "error" and "middle" fit the context into max_length minus the prefix
        and the continuation. The requests are tokenised on threads."""
        max_length = self.truncator.max_length
        policy = self.truncator.default_policy
        prepared: list[tuple[list[int], int]] = []
        seen: set[int] = set()
        for request, (prefix, context_ids, continuation_ids) in zip(
                requests, on_threads(self._encode_pair, requests, self.codec.settle), strict=True):
            first_time = id(request) not in seen
            seen.add(id(request))
            if policy == "left":
                if len(continuation_ids) > max_length:  # HFLM asserts here
                    raise ValueError(f"task {request.task_name}: a continuation of {len(continuation_ids)} tokens "
                                     f"(doc {request.doc_id}) is longer than max_length {max_length}; raise "
                                     f"--max-length (model_args max_length=...) to at least {len(continuation_ids)}")
                what = f"max_length {max_length} + 1 minus {len(continuation_ids)} continuation tokens"
                head = self.truncator.fit(prefix + context_ids, max_length + 1 - len(continuation_ids), policy,
                                          request.task_name, what, count=first_time)
                prepared.append((head + continuation_ids, len(continuation_ids)))
                continue
            budget = max_length - len(prefix) - len(continuation_ids)
            what = f"max_length {max_length} minus {len(continuation_ids)} continuation tokens"
            context_ids = self.truncator.fit(context_ids, budget, policy, request.task_name, what, count=first_time)
            prepared.append((prefix + context_ids + continuation_ids, len(continuation_ids)))
        return prepared

    def _encode_pair(self, request: Instance) -> tuple[list[int], list[int], list[int]]:
        """(prefix, context ids, continuation ids) of a (context, continuation) request: the
        continuation's ids are those of the whole text after the context's, as lm-eval's HFLM makes them."""
        context, continuation = request.args
        if not context:
            return self.codec.prefix or [self.codec.eot_token_id], [], self.codec.encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:  # keep word-boundary spaces with the continuation, as lm-eval does
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.codec.encode(context + continuation)
        context_ids = self.codec.encode(context)
        return self.codec.prefix, context_ids, whole[len(context_ids):]

    def loglikelihood(self, requests: list[Instance], cache_hook: CacheHook,
                      disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each request's continuation; each answer also goes to `cache_hook`.
        Requests that repeat a context read it once where the model allows (short_requests.py)."""
        prepared = self._prepare_loglikelihood(requests)
        rows, n_scored = [ids for ids, _ in prepared], [n for _, n in prepared]
        with tqdm(total=len(rows), desc="ccq loglikelihood", disable=disable_tqdm) as progress:
            scored = short_requests.score_rows(self, rows, n_scored, share=self.share_contexts, pad_id=self.pad_id,
                                               progress=progress)
        results = [(float(logprob.double().sum()), bool(greedy.all()))  # no tokens: (0.0, True)
                   for logprob, greedy in scored]
        check_finite_loglikelihoods(requests, results)  # before any answer reaches a cache
        for request, answer in zip(requests, results, strict=True):
            cache_hook.add_partial("loglikelihood", request.args, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], cache_hook: CacheHook,
                              disable_tqdm: bool = False) -> list[TokenNLL]:
        """Each text scored by its task's protocol (zeroshot.rolling_protocol: rolling_windows when given,
        else HFLM's windows for the zero-shot suite's wikitext and one carried pass for every other task)."""
        protocols = [rolling_protocol(request.task_name, self.rolling_windows) for request in requests]
        for request, protocol in zip(requests, protocols, strict=True):
            if request.task_name:
                self.rolling_protocols[request.task_name] = protocol
        results: list[TokenNLL | None] = [None] * len(requests)
        for protocol, score in (("hflm", self._rolling_windows), ("carry", self._rolling_carried)):
            indices = [i for i, p in enumerate(protocols) if p == protocol]
            if indices:
                for index, value in zip(indices, score([requests[i] for i in indices], cache_hook, disable_tqdm),
                                        strict=True):
                    results[index] = value
        return results  # type: ignore[return-value]

    def _rolling_windows(self, requests: list[Instance], cache_hook: CacheHook,
                         disable_tqdm: bool = False) -> list[TokenNLL]:
        """lm-eval HFLM's protocol: each text in disjoint windows of window_tokens predictions with one
        token of context (the first window: the prefix token, BOS else EOS, as HFLM's prefix_token_id), each
        window read from an empty state; lm-eval's own window function (lm_eval.utils). The text is encoded
        without special tokens, as HFLM with add_bos_token=False does. A window's row holds one token more than
        HFLM's input (its last scored token, which predicts nothing), so it is scored on rotary or no
        positions alike. TokenNLL holds every token's NLL, in text order."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        prefix_token = self.codec.prefix[0] if self.codec.prefix else self.codec.eot_token_id
        encoded = on_threads(self.codec.encode, [request.args[0] for request in requests], self.codec.settle)
        rows: list[list[int]] = []
        n_scored: list[int] = []
        owners: list[int] = []
        for owner, ids in enumerate(encoded):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=prefix_token, max_seq_len=self.window_tokens, context_len=1)):
                rows.append(context + continuation)
                n_scored.append(len(continuation))
                owners.append(owner)
        with tqdm(total=len(rows), desc="ccq loglikelihood_rolling (windows)", disable=disable_tqdm) as progress:
            scored = short_requests.score_rows(self, rows, n_scored, share=False, pad_id=self.pad_id,
                                               progress=progress)
        parts: list[list[torch.Tensor]] = [[] for _ in requests]
        for owner, (logprob, _) in zip(owners, scored, strict=True):
            parts[owner].append(logprob)
        results: list[TokenNLL] = []
        for request, logprobs in zip(requests, parts, strict=True):
            value = TokenNLL.from_token_nll((-torch.cat(logprobs).double()).tolist() if logprobs else [])
            results.append(value)
            cache_hook.add_partial("loglikelihood_rolling", request.args, value)
        return results

    def _rolling_carried(self, requests: list[Instance], cache_hook: CacheHook,
                         disable_tqdm: bool = False) -> list[TokenNLL]:
        """Each text scored whole in one recurrent pass. A pipeline keeps the GPU busy: all texts are
        tokenised at once on threads (tens of ms for a 20K-token text; the fast tokenizers release the
        GIL), one row at a time starts on the first text while the rest are tokenised, and a batch's
        scores are copied back and unpacked while the next batch runs. Each row starts with the text's
        prefix (carry_prefix)."""
        results: list[TokenNLL | None] = [None] * len(requests)
        prefixes = [self.carry_prefix(request.task_name) for request in requests]
        encoded = ahead_on_threads(self.codec.encode, [request.args[0] for request in requests],
                                   self.codec.settle)
        if self.sizer.scoring_max_rows == 1:  # in request order, each text as soon as it is tokenised
            rolling: Iterator[list[tuple[int, list[int]]]] = (
                [(i, prefixes[i] + ids)] for i, ids in enumerate(encoded))
            n_batches = len(requests)
        else:  # equal-length batches need every length first
            rows_all = [prefix + ids for prefix, ids in zip(prefixes, encoded, strict=True)]
            grouped = list(batches([len(r) for r in rows_all], self.sizer.rows_for(generation=False)))
            rolling = iter([[(i, rows_all[i]) for i in batch] for batch in grouped])
            n_batches = len(grouped)
        pending = None
        progress = tqdm(rolling, total=n_batches, desc="ccq loglikelihood_rolling", disable=disable_tqdm)
        for batch in progress:
            started = self._start_rolling(batch)
            if pending is not None:
                self._finish_rolling(pending, requests, results, cache_hook)
            pending = started
        if pending is not None:
            self._finish_rolling(pending, requests, results, cache_hook)
        return results  # type: ignore[return-value]

    def carry_prefix(self, task_name: str | None) -> list[int]:
        """The unscored tokens before a text read in one pass: [BOS] when the tokenizer has one; else, for the
        zero-shot suite's rolling tasks, [EOS], so that the first token is scored as in HFLM's first window
        and the log-likelihood covers every token lm-eval's word_perplexity divides by (the page's words);
        else none: the text's first token is then context, not scored (our perplexity tasks)."""
        if self.codec.prefix or task_name not in HFLM_ROLLING_TASKS:
            return self.codec.prefix
        return [self.codec.eot_token_id]

    def _start_rolling(self, batch: list[tuple[int, list[int]]]):
        """Queue the scoring of one batch of rows; returns what _finish_rolling needs."""
        indices, rows = [i for i, _ in batch], [row for _, row in batch]
        self.sizer.record(len(rows))
        longest = max(len(row) for row in rows)
        max_length = self.truncator.max_length
        if longest > max_length and not self._warned_rolling_over_length:
            # Rolling scoring is the whole text by definition (no truncation); say so once.
            logger.warning("loglikelihood_rolling: a text of %d tokens exceeds max_length %d; it is scored "
                           "whole in one recurrent pass", longest, max_length)
            self._warned_rolling_over_length = True
        if len(rows[0]) < 2:  # nothing to predict
            return indices, torch.zeros(len(rows), 0), None
        logprob, _ = self.score(self.runtime.tensor(rows), 0)
        return indices, *self.runtime.to_host(logprob)

    @staticmethod
    def _finish_rolling(started, requests: list[Instance], results: list, cache_hook: CacheHook) -> None:
        indices, logprob, copied = started
        if copied is not None:
            copied.synchronize()  # waits for this batch's copy only, not for work queued after it
        for row, index in enumerate(indices):
            value = TokenNLL.from_token_nll((-logprob[row]).tolist())
            results[index] = value
            cache_hook.add_partial("loglikelihood_rolling", requests[index].args, value)
