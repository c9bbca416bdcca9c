"""Generation for the lm-eval adapter (`Generator`): chunked prefill, then one token per step with the
recurrent cache; prompts of any length decode together for purely recurrent fla models.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import CacheHook
from tqdm import tqdm

from ccq_eval.harness.batching import BatchSizer
from ccq_eval.harness.model_runtime import ModelRuntime
from ccq_eval.harness.resume import request_keys
from ccq_eval.harness.scoring import NonFiniteOutputError, Scorer, batches, non_finite_message
from ccq_eval.harness.tokens import TokenCodec, on_threads
from ccq_eval.harness.truncation import Truncator

logger = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256
# With shared_prefill, the prompts of a batch that differ in length by at most this many tokens per row are
# prefilled together up to the shortest of them, and the longer ones' last tokens go through the decode
# steps (one graph replay each; prefill_groups). A replayed step costs a small fraction of one row's
# prefill: this keeps the fed tokens well below break-even.
FORCED_TOKENS_PER_ROW = 8
# generation_kwargs keys this adapter understands; anything else is an error, not ignored.
_GEN_KWARGS = {
    "until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "ccq_truncation", "num_beams",
}


def _stack_states(states: list[Any]) -> Any:
    """One batched state from per-row states of the same structure (tensors stacked on dim 0)."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=0)
    if isinstance(first, dict):
        return {key: _stack_states([s[key] for s in states]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_stack_states(list(items)) for items in zip(*states, strict=True))
    if first is None:
        return None
    raise TypeError(f"cannot stack cache states of type {type(first).__name__}")


def _stack_caches(caches: list[Any]) -> Any:
    """fla Caches of one or more rows each -> one Cache of all rows, in order. Recurrent layers keep no
    per-position state, so rows of different prompt lengths decode together without padding."""
    stacked = caches[0]
    for index, layer in enumerate(stacked.layers):
        layer.state = _stack_states([cache.layers[index].state for cache in caches])
    return stacked


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """Runs of consecutive rows to prefill together up to the run's shortest prompt: a run's lengths
    differ by at most FORCED_TOKENS_PER_ROW per row of the run (the batch's rows come longest first)."""
    groups: list[list[int]] = []
    for row, length in enumerate(lengths):
        if groups:
            run = [lengths[i] for i in groups[-1]] + [length]
            if max(run) - min(run) <= FORCED_TOKENS_PER_ROW * len(run):
                groups[-1].append(row)
                continue
        groups.append([row])
    return groups


class PrefillAhead:
    """The next batch's prefill, run on a worker thread (and on CUDA a stream of its own) while the
    current batch decodes. Why: a prefill is host-bound (the Python and kernel launches of every layer)
    while decode steps replayed from CUDA graphs are GPU-bound, their host mostly waiting, so the two
    overlap. The prefill runs the kernels it would run alone, so no answer changes. Before the decode
    stream reads a prefill's logits and cache it waits for the prefill's end, and those tensors are
    marked as used on it (record_stream): the allocator then keeps their memory from the worker's stream
    until the decode stream is done with them. Nothing that captures a CUDA graph may run while a
    prefill is in flight (a capture refuses other threads' launches): start one only after the current
    batch's decode graph is set up."""

    def __init__(self, prefill: Callable[[list[list[int]]], tuple[torch.Tensor, Any, list[list[int]]]],
                 device: torch.device) -> None:
        self._prefill = prefill
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ccq-prefill-ahead")
        self._pending: tuple[list[list[int]], Future] | None = None
        self.started = 0  # prefills started ahead (for tests and benchmarks)

    def start(self, prompts: list[list[int]]) -> None:
        """Start prefilling `prompts` (a batch taken next with `take`)."""
        if self._pending is not None:
            raise RuntimeError("PrefillAhead.start: the previous prefill was not taken")
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        self._pending = (prompts, self._pool.submit(self._run, prompts))
        self.started += 1

    def _run(self, prompts: list[list[int]]) -> tuple[tuple[torch.Tensor, Any, list[list[int]]], Any]:
        # no_grad and the current stream are per thread: set both here.
        with torch.no_grad():
            if self._stream is None:
                return self._prefill(prompts), None
            with torch.cuda.stream(self._stream):
                prefilled = self._prefill(prompts)
                done = torch.cuda.Event()
                done.record(self._stream)
            return prefilled, done

    def take(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Any, list[list[int]]] | None:
        """The prefill of `prompts` if it was started ahead (None otherwise), ready for the current stream."""
        if self._pending is None or self._pending[0] is not prompts:
            return None
        _, future = self._pending
        self._pending = None
        prefilled, done = future.result()
        if done is not None:
            from ccq_eval.model.cuda_graphs.decode import state_tensors

            current = torch.cuda.current_stream(self._device)
            current.wait_event(done)
            logits, cache, _ = prefilled
            for tensor in (logits, *state_tensors(cache)):
                tensor.record_stream(current)
        return prefilled

    def close(self) -> None:
        """Wait for a prefill still in flight (its result is dropped) and stop the worker."""
        if self._pending is not None:
            self._pending[1].exception()  # waits; an error there matters only to a caller that takes it
            self._pending = None
        self._pool.shutdown(wait=True)


class NonFiniteGenerationError(NonFiniteOutputError):
    """The model gave NaN or infinite logits while generating: its answers would be arbitrary tokens, so
    the unit fails (as a NaN log-likelihood fails a scored unit) instead of being stored as wrong answers."""


NON_FINITE_GENERATION = non_finite_message("logits while generating")


def as_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no", ""):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    return bool(value)


class Generator:
    """generate_until of the adapter: chunked prefill by `scorer`, then one token per step through
    `runtime` with the recurrent cache.

    Prompts with the same decoding settings go as many at a time as `sizer` allows for the longest of
    them; for a recurrent fla model (runtime.recurrent) prompts of any length decode together. With
    `cuda_graphs`, each decode step is replayed from a CUDA graph (ccq_eval.model.cuda_graphs.decode; one
    per batch size, reused by later batches). `seed`: with a request's identity, the seed of its sampling.
    Prompts are fitted by `truncator` under each request's policy. `prefill_ahead` (on with CUDA graphs):
    while a batch decodes, the next one is prefilled beside it (PrefillAhead) where the memory free then
    holds it by the sizer's row cost. `shared_prefill`: prompts of nearly one length are prefilled
    together up to the shortest of them (_prefill); off, each prompt is prefilled whole and alone, on the
    kernels batch 1 runs, so that a row's answer does not depend on its batch's other prompts.
    """

    def __init__(self, runtime: ModelRuntime, scorer: Scorer, codec: TokenCodec, truncator: Truncator, *,
                 sizer: BatchSizer, cuda_graphs: bool, seed: int, shared_prefill: bool = False) -> None:
        self.runtime = runtime
        self.scorer = scorer
        self.codec = codec
        self.truncator = truncator
        self.sizer = sizer
        self.cuda_graphs = cuda_graphs
        self.seed = seed
        self.decode_graphs: dict[int, Any] = {}  # batch size -> GraphedDecodeStep (see decode_graph)
        self.last_decode_steps = 0  # one-token model calls of the last generate batch (for benchmarks)
        # Why off by default: a shared prefill ends the longer prompts on the one-token recurrent kernel
        # where batch 1 runs the chunk kernel, and in half precision the two round far enough apart (an
        # untrained fla DeltaNet on CUDA) to change a greedy answer.
        self.shared_prefill = shared_prefill
        self.prefill_ahead = cuda_graphs
        self.last_prefills_ahead = 0  # batches of the last generate_until prefilled while another decoded

    @property
    def prefills_alone(self) -> bool:
        """Whether a batch's prompts are prefilled one forward at a time (a recurrent fla model without
        shared_prefill; prompts of one length together as far as memory allows, see _prefill), so that
        the batch is sized by its rows' states and one forward."""
        return self.runtime.recurrent and not self.shared_prefill

    def eos_ids(self) -> set[int]:
        """Token ids that end an answer: the tokenizer's EOS and the model's generation_config ones."""
        eos_token_id = self.codec.eot_token_id
        ids = {eos_token_id} if eos_token_id is not None else set()
        gen_eos = getattr(getattr(self.runtime.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(int(x) for x in gen_eos)
        return ids

    def parse_gen_kwargs(self, gen_kwargs: dict[str, Any], task_name: str | None) -> dict[str, Any]:
        unknown = set(gen_kwargs) - _GEN_KWARGS
        if unknown:
            raise ValueError(f"task {task_name}: unsupported generation_kwargs {sorted(unknown)}; "
                             f"supported: {sorted(_GEN_KWARGS)}")
        if int(gen_kwargs.get("num_beams", 1)) != 1:
            raise ValueError(f"task {task_name}: beam search (num_beams={gen_kwargs['num_beams']}) is not supported")
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
            raise ValueError(f"task {task_name}: `until` must be a string or a list of strings, got {until!r}")
        max_gen_toks = int(gen_kwargs.get("max_gen_toks", gen_kwargs.get("max_new_tokens", DEFAULT_MAX_GEN_TOKS)))
        temperature = float(gen_kwargs.get("temperature", 1.0) or 0.0)
        do_sample = as_bool(gen_kwargs.get("do_sample", False)) and temperature > 0.0
        eos_text = self.codec.eos_text
        stops = [s for s in until if s] + ([eos_text] if eos_text and eos_text not in until else [])
        return {
            "until": tuple(stops), "max_gen_toks": max_gen_toks, "do_sample": do_sample,
            "temperature": temperature, "top_k": int(gen_kwargs.get("top_k") or 0),
            "top_p": float(gen_kwargs.get("top_p") or 1.0),
            "policy": self.truncator.policy_of(gen_kwargs, task_name),
        }

    def sampling_generator(self, request_id: str) -> torch.Generator:
        """The random numbers of one sampled request: seeded by the adapter's seed and the request's
        identity (resume.request_keys: its arguments and repeat index), never by its place in the run, so a
        resumed or differently batched run draws the same answers."""
        digest = hashlib.sha256(f"{self.seed}:{request_id}".encode()).digest()
        return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    @staticmethod
    def next_tokens(logits: torch.Tensor, settings: dict[str, Any],
                    generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """The next token of each row: the argmax, or with do_sample a draw from each row's generator."""
        if not settings["do_sample"]:
            return logits.argmax(-1)
        scores = logits.float() / settings["temperature"]
        if settings["top_k"] > 0:
            kth = torch.topk(scores, min(settings["top_k"], scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if settings["top_p"] < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_scores.softmax(-1) >= settings["top_p"]  # keep the first token always
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        probs = scores.softmax(-1).cpu()
        drawn = [torch.multinomial(row, 1, generator=generator)
                 for row, generator in zip(probs, generators or [], strict=True)]
        return torch.cat(drawn).to(logits.device)

    def _prepare(self, requests: list[Instance]) -> list[tuple[list[int], dict[str, Any]]]:
        """(prompt ids, decoding settings) of each request, the prompt fitted into what max_length leaves."""
        max_length = self.truncator.max_length
        prefix = self.codec.prefix
        settings_all = [self.parse_gen_kwargs(dict(request.args[1] or {}), request.task_name)
                        for request in requests]

        def fitted(index: int) -> tuple[list[int], bool]:  # tokenising and cutting: on threads
            settings, task_name = settings_all[index], requests[index].task_name
            budget = max_length - settings["max_gen_toks"] - len(prefix)
            what = f"max_length {max_length} minus max_gen_toks {settings['max_gen_toks']}"
            return self.truncator.cut(self.codec.encode(requests[index].args[0]), budget, settings["policy"],
                                      task_name, what)

        prepared: list[tuple[list[int], dict[str, Any]]] = []
        seen: set[int] = set()
        for request, settings, (content, truncated) in zip(
                requests, settings_all, on_threads(fitted, range(len(requests)), self.codec.settle),
                strict=True):
            if id(request) not in seen:  # a repeated Instance (data-parallel padding, `repeats`) counts once
                self.truncator.count(settings["policy"], request.task_name, truncated)
            seen.add(id(request))
            prepared.append((prefix + content, settings))
        if any(len(ids) == 0 for ids, _ in prepared):
            raise ValueError("generate_until: empty prompt and no BOS token to start from")
        return prepared

    def _batches(self, prepared: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
        """Batch prompts with identical decoding settings. Without padding, a batch needs one length,
        except for recurrent fla models: each prompt is prefilled alone and their recurrent states are
        stacked for decoding together (decoding needs no padding)."""
        def group_key(i: int) -> tuple:
            s = prepared[i][1]
            return (s["until"], s["max_gen_toks"], s["do_sample"], s["temperature"], s["top_k"], s["top_p"])

        groups: dict[tuple, list[int]] = defaultdict(list)
        for i in range(len(prepared)):
            groups[group_key(i)].append(i)
        grouped = []
        rows_for = self.sizer.rows_for(generation=True, prefill_alone=self.prefills_alone)
        for indices in groups.values():
            for sub in batches([len(prepared[i][0]) for i in indices], rows_for,
                               any_length=self.runtime.recurrent):
                grouped.append([indices[j] for j in sub])
        return grouped

    def generate_until(self, requests: list[Instance], cache_hook: CacheHook, disable_tqdm: bool = False,
                       request_ids: list[str] | None = None) -> list[str]:
        """Answers of `requests`; each also goes to `cache_hook`. request_ids (resume.request_keys of the
        whole unit's requests, from the resuming wrapper) identify each request for its sampling seed; by
        default they are computed over `requests`."""
        if request_ids is None:
            request_ids = request_keys("generate_until", requests)
        prepared = self._prepare(requests)
        grouped = self._batches(prepared)
        batch_prompts = [[prepared[i][0] for i in batch] for batch in grouped]  # one list per batch: take() matches it
        results: list[str | None] = [None] * len(requests)
        ahead = PrefillAhead(self._prefill, self.runtime.device) if self.prefill_ahead and len(grouped) > 1 else None
        try:
            for n, batch in enumerate(tqdm(grouped, desc="ccq generate_until", disable=disable_tqdm)):
                settings = prepared[batch[0]][1]
                self.sizer.record(len(batch))
                generators = ([self.sampling_generator(request_ids[i]) for i in batch] if settings["do_sample"]
                              else None)
                prompts = batch_prompts[n]
                following = batch_prompts[n + 1] if n + 1 < len(grouped) else None

                def start_next(following=following) -> None:
                    if ahead is not None and following is not None and self._room_for(following):
                        ahead.start(following)

                texts = self.generate(prompts, settings, generators,
                                      prefilled=ahead.take(prompts) if ahead is not None else None,
                                      on_decode_ready=start_next)
                for index, text in zip(batch, texts, strict=True):
                    results[index] = text
                    cache_hook.add_partial("generate_until", requests[index].args, text)
        finally:
            self.last_prefills_ahead = ahead.started if ahead is not None else 0
            if ahead is not None:
                ahead.close()
        return results  # type: ignore[return-value]

    def _room_for(self, prompts: list[list[int]]) -> bool:
        """Whether a batch of `prompts` can be prefilled beside the one decoding: on CUDA, where its planned
        memory (the sizer's row cost) fits in what is free now; elsewhere (only where asked for) always."""
        if self.runtime.device.type != "cuda":
            return True
        return self.sizer.fits_now([len(prompt) for prompt in prompts], generation=True,
                                   prefill_alone=self.prefills_alone)

    def decode_graph(self, cache: Any, batch: int) -> Any:
        """The captured decode step for `batch` rows, started from `cache`: captured once per batch
        size and cache layout, then reused by later generate batches (the model must not change in
        between: a graph replays the kernels and weights it captured)."""
        from ccq_eval.model.cuda_graphs.decode import GraphedDecodeStep

        graph = self.decode_graphs.get(batch)
        if graph is not None and graph.matches(cache):
            graph.load(cache)
            return graph
        graph = GraphedDecodeStep(self.runtime.backbone, self.runtime.lm_head, cache, batch)
        self.decode_graphs[batch] = graph
        return graph

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Any, list[list[int]]]:
        """(logits at the last prefilled position of each row, the cache of all rows, each row's prompt
        tokens left for the decode steps to feed). Prompts of one length take one pass, or where the batch
        was sized for prefills one at a time (prefills_alone) as few passes as the free memory allows.
        Otherwise (recurrent fla models only, see _batches) each prompt is prefilled alone, or with
        shared_prefill each run of rows in prefill_groups together up to its shortest prompt."""
        tensor = self.runtime.tensor
        lengths = [len(p) for p in prompts]
        if len(set(lengths)) == 1:
            together = self.sizer.prefill_rows(lengths[0], len(prompts)) if self.prefills_alone else len(prompts)
            groups = [list(range(start, min(start + together, len(prompts))))
                      for start in range(0, len(prompts), together)]
        elif self.shared_prefill:
            groups = prefill_groups(lengths)
        else:
            groups = [[i] for i in range(len(prompts))]
        logits_parts, caches, tails = [], [], []
        for group in groups:
            shortest = min(lengths[i] for i in group)
            _, _, logits, cache = self.scorer.run(tensor([prompts[i][:shortest] for i in group]), shortest)
            logits_parts.append(logits)
            caches.append(cache)
            tails += [prompts[i][shortest:] for i in group]
        cache = caches[0] if len(caches) == 1 else _stack_caches(caches)
        return torch.cat(logits_parts), cache, tails

    def _step_tokens(self, logits: torch.Tensor, settings: dict[str, Any], generators: list[torch.Generator] | None,
                     tails: list[deque]) -> tuple[torch.Tensor, list[bool]]:
        """The token each row feeds next: its next prompt token while its prompt lasts, else its choice
        from `logits` (drawn only for those rows, so a sampled answer does not depend on its batch); and
        which rows chose."""
        chose = [not tail for tail in tails]
        if all(chose):
            return self.next_tokens(logits, settings, generators), chose
        rows = [row for row, free in enumerate(chose) if free]
        chosen = (self.next_tokens(logits[rows], settings, [generators[r] for r in rows] if generators else None)
                  .tolist() if rows else [])
        picks = iter(chosen)
        tokens = [next(picks) if free else tail.popleft() for free, tail in zip(chose, tails, strict=True)]
        return torch.tensor(tokens, device=logits.device), chose

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], settings: dict[str, Any],
                 generators: list[torch.Generator] | None = None,
                 prefilled: tuple[torch.Tensor, Any, list[list[int]]] | None = None,
                 on_decode_ready: Callable[[], None] | None = None) -> list[str]:
        """Chunked prefill, then one token per step with the recurrent cache; with do_sample each prompt
        draws from its own generator. Rows whose prompt is longer than the batch's shortest may feed
        their last prompt tokens through the first decode steps (see _prefill). prefilled: what
        _prefill(prompts) returned, if it ran already (PrefillAhead); on_decode_ready: called once the
        decode graph is set up, before the first step."""
        eos_ids = self.eos_ids()
        stops = settings["until"]
        max_new = settings["max_gen_toks"]
        # A stop string that ends in the newest token lies within the row's last `window` tokens (each token
        # but special ones gives at least one byte; the margin covers those). A stop the window missed
        # only costs steps: the text is cut at the first stop of the whole decoded answer below.
        window = 2 * max((len(stop.encode("utf-8")) for stop in stops), default=0) + 8
        logits, cache, tails = self._prefill(prompts) if prefilled is None else prefilled
        tails = [deque(tail) for tail in tails]
        graphed = None
        if self.cuda_graphs and (max_new > 1 or any(tails)):
            graphed = self.decode_graph(cache, len(prompts))
        if on_decode_ready is not None:
            on_decode_ready()
        generated: list[list[int]] = [[] for _ in prompts]
        done = [max_new < 1] * len(prompts)
        self.last_decode_steps = 0  # one-token model calls of this batch (graph replays included)
        finite = torch.ones((), dtype=torch.bool, device=logits.device)  # checked once, after the batch
        while not all(done):
            finite &= torch.isfinite(logits).all()
            if settings.get("do_sample") and not bool(finite):  # a draw from NaN probabilities would fail obscurely
                raise NonFiniteGenerationError(NON_FINITE_GENERATION)
            tokens, chose = self._step_tokens(logits, settings, generators, tails)
            budget_ends = all(d or (c and len(g) + 1 >= max_new) for d, c, g in zip(done, chose, generated))
            if graphed is not None and not budget_ends:
                # The next step is queued on the GPU before this step's tokens are read back, so the host's
                # bookkeeping below overlaps it (after a batch's EOS or stop string it runs for nothing).
                host, copied = self.runtime.to_host(tokens)
                logits = graphed(tokens)
                self.last_decode_steps += 1
                copied.synchronize()
                token_list = host.tolist()
            else:
                token_list = tokens.tolist()
            for row, token in enumerate(token_list):
                if done[row] or not chose[row]:
                    continue
                if token in eos_ids:
                    done[row] = True
                    continue
                generated[row].append(token)
                if len(generated[row]) >= max_new:
                    done[row] = True
                elif stops:
                    recent = self.codec.decode(generated[row][-window:])
                    if any(stop in recent for stop in stops):
                        done[row] = True
            if all(done) or graphed is not None:
                continue
            step_logits, cache = self.runtime.forward(tokens.view(-1, 1), cache, 1)
            logits = step_logits[:, -1]
            self.last_decode_steps += 1
        if not bool(finite):
            raise NonFiniteGenerationError(NON_FINITE_GENERATION)
        texts = []
        for ids in generated:
            text = self.codec.decode(ids)
            for stop in stops:
                cut = text.find(stop)
                if cut != -1:
                    text = text[:cut]
            texts.append(text)
        return texts
