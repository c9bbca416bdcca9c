"""lm-eval model adapter for recurrent (linear-attention) causal LMs, registered as "ccq".

Why not lm-eval's HFLM: it takes max_length from the config (2048 for fla models) and
left-truncates silently, its rolling log-likelihood restarts the state every window, and
it returns one summed number per document. This adapter instead

* scores a whole text in one pass: the model is called on successive slices of
  `chunk_size` tokens with the same cache object, so the recurrent state is carried across
  slices (never disjoint windows). For fla models the backbone's hidden states come back and
  the LM head plus fp32 log-softmax run `logits_chunk` positions at a time, so neither the
  logits nor their fp32 copy exist for a whole slice at once (other models: per slice);
* returns per-token NLLs from loglikelihood_rolling (`TokenNLL`);
* decodes with the recurrent cache (chunked prefill, then one token per step);
* truncates prompts only by the policy a task names (`ccq_truncation` in its
  generation_kwargs: "middle" | "left" | "error", default "error") and counts what it cut.

BOS convention (all request types): when the tokenizer defines a BOS token it is prepended
as unscored context, so every token of the text is scored. When it has none, the first
token of the text is unscored context (rolling) — except for `loglikelihood` with an
empty context, where EOS serves as the context token, as lm-eval does.

Use from Python with an already-loaded model:
    CCQEvalLM(model=model, tokenizer=tokenizer, max_length=20480, batch_size=1)
or by name from lm-eval (import this module first so "ccq" is registered):
    simple_evaluate(model="ccq", model_args="pretrained=<name or path>,max_length=20480", ...)
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import lm_eval.models  # noqa: F401  (built-ins first: get_model() only imports them into an empty registry)
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ccq_eval.token_logprob import token_logprob
from ccq_eval.truncation import truncate_tokens

logger = logging.getLogger(__name__)

# Linear attention has no positional limit; without a user/task value we allow this much.
DEFAULT_MAX_LENGTH = 32768
# One model call per 32K tokens: each call costs a fixed host-side overhead (about 40 ms for a
# 24-layer fla model on an H200, measured in benchmarks/results/h200), while the recurrent state
# keeps activation memory per call small; logits are formed LOGITS_CHUNK positions at a time.
DEFAULT_CHUNK_SIZE = 32768
DEFAULT_LOGITS_CHUNK = 4096
DEFAULT_MAX_GEN_TOKS = 256
TRUNCATION_POLICIES = ("middle", "left", "error")
# generation_kwargs keys this adapter understands; anything else is an error, not ignored.
_GEN_KWARGS = {
    "until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "ccq_truncation", "num_beams",
}


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


def _parse_batch_size(batch_size: Any) -> int:
    if batch_size is None:
        return 1
    if isinstance(batch_size, str):
        if batch_size.startswith("auto"):
            # Probing (bs, max_length) forwards at 20K tokens costs more than it saves.
            logger.warning("batch_size=%r: automatic batch size is not supported; using 1", batch_size)
            return 1
        if not batch_size.isdigit():
            raise ValueError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
        batch_size = int(batch_size)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return int(batch_size)


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no", ""):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    return bool(value)


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's CLI sends device "cuda:0" by default, also on CPU-only machines.
        logger.warning("device %r requested but CUDA is not available; using cpu", device)
        return torch.device("cpu")
    return torch.device(device)


def _backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """(backbone, LM head) of an fla causal LM, whose logits are exactly lm_head(backbone(...)[0])
    (FLAForCausalLM.forward without labels); (None, None) for any other model."""
    try:
        from fla.models.modeling_utils import FLAForCausalLM
    except ImportError:  # fla absent: no fla model can be here
        return None, None
    if isinstance(model, FLAForCausalLM):
        return model.get_decoder(), model.get_output_embeddings()
    return None, None


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
    """fla Caches of single rows -> one Cache of all rows, in order. Recurrent layers keep no
    per-position state, so rows of different prompt lengths decode together without padding."""
    stacked = caches[0]
    for index, layer in enumerate(stacked.layers):
        layer.state = _stack_states([cache.layers[index].state for cache in caches])
    return stacked


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    """Keyword names the model's forward accepts, following `**kwargs` pass-through into the
    parent class's forward (our CCQ classes wrap fla's forward that way)."""
    names: set[str] = set()
    for cls in type(model).__mro__:
        if cls is torch.nn.Module:
            break
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        params = inspect.signature(forward).parameters
        names.update(params)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return names


@register_model("ccq")
class CCQEvalLM(LM):
    """lm-eval LM for recurrent causal LMs with chunked, state-carrying scoring.

    Args:
        model: an already-loaded causal LM (HF-style forward with a cache), or None.
        tokenizer: its tokenizer (required with `model`).
        pretrained: name or path for `ccq_eval.loading.load_model` (when `model` is None).
        max_length: context budget in tokens (prompt + generated tokens for generation).
            Default DEFAULT_MAX_LENGTH, never the config's max_position_embeddings.
        batch_size: rows per forward; scoring batches only sequences of equal token length
            (no padding: a recurrent state has no attention mask to hide pad tokens); generation
            with a recurrent fla model prefills each prompt alone and decodes up to batch_size
            prompts of any length together.
        chunk_size: tokens per forward slice when scoring / prefilling.
        logits_chunk: positions whose logits are formed at once (fla models; others: a slice).
        cuda_graphs: replay each one-token decode step (ccq_eval.graphed_decode; one graph per
            batch size, reused by later batches) and each scoring forward that fits one slice
            (ccq_eval.graphed_score) from CUDA graphs; recurrent fla models on CUDA. Off by
            default: graphs hold GPU memory, and scores differ from eager ones by rounding (other
            matrix shapes).
        default_truncation: policy for requests that name none (generation without
            `ccq_truncation`, and loglikelihood). Default "error".
        device, dtype, allow_pickle, trust_remote_code: passed to load_model.
        seed: for sampling when a task asks for do_sample.
        max_batch_size and other lm-eval keyword arguments are accepted and ignored.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        pretrained: str | None = None,
        max_length: int | str | None = None,
        batch_size: int | str | None = 1,
        chunk_size: int | str = DEFAULT_CHUNK_SIZE,
        logits_chunk: int | str = DEFAULT_LOGITS_CHUNK,
        cuda_graphs: bool | str = False,
        default_truncation: str = "error",
        device: str | None = None,
        dtype: str | None = None,
        allow_pickle: bool | str = False,
        trust_remote_code: bool | str = False,
        seed: int | str = 1234,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        ignored = {k: v for k, v in kwargs.items() if k not in ("max_batch_size",)}
        if ignored:
            logger.warning("ccq adapter: ignoring unknown model arguments %s", sorted(ignored))

        self.accelerator = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Launched with `accelerate launch` / torchrun: data-parallel over processes.
            # The evaluator hands each rank its share of the documents.
            from accelerate import Accelerator

            # cpu=True is what makes accelerate use gloo across CPU processes (no CUDA, or device=cpu).
            on_cpu = not torch.cuda.is_available() or str(device or "").startswith("cpu")
            self.accelerator = Accelerator(cpu=on_cpu)
            self._rank = self.accelerator.process_index
            self._world_size = self.accelerator.num_processes

        if model is None:
            if pretrained is None:
                raise ValueError("ccq adapter needs either model=<loaded model> (with tokenizer=) or "
                                 "pretrained=<registry name or path>")
            target = self.accelerator.device if self.accelerator is not None else _resolve_device(device)
            from ccq_eval.loading import load_model  # lazy: loading pulls in fla and our models

            model, loaded_tokenizer = load_model(
                str(pretrained), device=str(target), dtype=dtype, allow_pickle=_as_bool(allow_pickle),
                trust_remote_code=_as_bool(trust_remote_code),
            )
            tokenizer = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else loaded_tokenizer
        elif tokenizer is None or isinstance(tokenizer, str):
            raise ValueError("ccq adapter: model= was given without a tokenizer object (tokenizer=)")
        if self.accelerator is not None:
            model = model.to(self.accelerator.device)

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pretrained = pretrained if pretrained is not None else getattr(
            getattr(model, "config", None), "_name_or_path", type(model).__name__)
        self._device = next(model.parameters()).device
        if self._device.type == "cuda":
            # The model's GPU made current: CUDA graphs capture on the current device's streams, and
            # kernels that take no device from their inputs launch there (device="cuda:1").
            torch.cuda.set_device(self._device)

        if max_length is None:
            logger.info("ccq adapter: no max_length given; using %d tokens (linear attention has no "
                        "positional limit; pass max_length=... to set the context budget)", DEFAULT_MAX_LENGTH)
            max_length = DEFAULT_MAX_LENGTH
        self._max_length = int(max_length)
        self._batch_size = _parse_batch_size(batch_size)
        self.chunk_size = int(chunk_size)
        self.logits_chunk = int(logits_chunk)
        if self._max_length < 2 or self.chunk_size < 1 or self.logits_chunk < 1:
            raise ValueError(f"max_length must be >= 2, chunk_size and logits_chunk >= 1; got {max_length}, "
                             f"{chunk_size}, {logits_chunk}")
        if default_truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"default_truncation={default_truncation!r}; valid: {', '.join(TRUNCATION_POLICIES)}")
        self.default_truncation = default_truncation
        self._generator = torch.Generator(device="cpu").manual_seed(int(seed))

        # Model-agnostic calling convention: fla reads `past_key_values`; transformers >= 5.2x
        # renamed it `cache`. Pick whichever the forward declares.
        params = _forward_parameters(self.model)
        self._cache_kwarg = "past_key_values" if "past_key_values" in params else (
            "cache" if "cache" in params else "past_key_values")
        self._has_logits_to_keep = "logits_to_keep" in params
        self._backbone, self._lm_head = _backbone_and_head(self.model)
        # Purely recurrent fla models (no hybrid attention layers, config.attn) keep no per-position
        # state, so prompts of different lengths can decode in one batch.
        self._stackable = self._backbone is not None and not getattr(self.model.config, "attn", None)
        self.last_decode_steps = 0  # one-token model calls of the last generate batch (for benchmarks)
        self.cuda_graphs = _as_bool(cuda_graphs)
        if self.cuda_graphs and (self._device.type != "cuda" or not self._stackable):
            raise ValueError("cuda_graphs=True needs a recurrent fla model (GLA / Gated DeltaNet) on a CUDA "
                             f"device; got {type(self.model).__name__} on {self._device}")
        self._graphed_scoring = None
        self._decode_graphs: dict[int, Any] = {}  # batch size -> GraphedDecodeStep (see _decode_graph)
        if self.cuda_graphs:
            from ccq_eval.graphed_score import GraphedScoring

            # Graphs of at most one slice: a longer text's cache would be built inside the capture.
            self._graphed_scoring = GraphedScoring(self._score_eagerly, self._device, self.chunk_size)

        # Truncation bookkeeping (the runner copies it into the results metadata).
        self.truncation_policy_counts: Counter[str] = Counter()  # policy -> requests that used it
        self.n_truncated = 0  # requests whose prompt was cut
        self.truncation_by_task: dict[str, dict[str, Any]] = {}
        self._warned_rolling_over_length = False

    # ------------------------------------------------------------------ properties
    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "bos_token_id", None)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix(self) -> list[int]:
        """Unscored context put before every text: [BOS] when the tokenizer has one."""
        return [self.bos_token_id] if self.bos_token_id is not None else []

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(int(x) for x in gen_eos)
        return ids

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ data parallel
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.accelerator is None or self.world_size <= 1:
            return tensor
        return self.accelerator.gather(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj=obj, object_gather_list=result, dst=dst)
        return result

    def barrier(self) -> None:
        if self.accelerator is not None and self.world_size > 1:
            self.accelerator.wait_for_everyone()

    @property
    def truncation_stats(self) -> dict[str, Any]:
        """This process's truncation record: {"policy_counts", "n_truncated", "by_task"}."""
        return {"policy_counts": dict(self.truncation_policy_counts), "n_truncated": self.n_truncated,
                "by_task": {task: dict(stats) for task, stats in self.truncation_by_task.items()}}

    def truncation_summary(self) -> dict[str, Any]:
        """Truncation counts of this process, summed over all ranks when data-parallel
        (collective: call it on every rank). Returns {"policy_counts", "n_truncated", "by_task"}."""
        local = self.truncation_stats
        if self.world_size <= 1:
            return local
        parts = [None] * self.world_size
        torch.distributed.all_gather_object(parts, local)
        merged: dict[str, Any] = {"policy_counts": Counter(), "n_truncated": 0, "by_task": {}}
        for part in parts:
            merged["policy_counts"].update(part["policy_counts"])
            merged["n_truncated"] += part["n_truncated"]
            for task, stats in part["by_task"].items():
                into = merged["by_task"].setdefault(task, {"policy": stats["policy"], "n_requests": 0,
                                                            "n_truncated": 0})
                into["n_requests"] += stats["n_requests"]
                into["n_truncated"] += stats["n_truncated"]
        merged["policy_counts"] = dict(merged["policy_counts"])
        return merged

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

    # ------------------------------------------------------------------ truncation
    def _fit(self, content: list[int], budget: int, policy: str, task_name: str | None,
             what: str, count: bool = True) -> list[int]:
        """Apply `policy` so that `content` fits `budget` tokens; count what was done (`count`
        False for a repeated Instance: lm-eval's data-parallel padding and `repeats` reuse one)."""
        if policy not in TRUNCATION_POLICIES:
            raise ValueError(f"ccq_truncation={policy!r} (task {task_name}); valid: {', '.join(TRUNCATION_POLICIES)}")
        stats = self.truncation_by_task.setdefault(str(task_name), {"policy": policy, "n_requests": 0,
                                                                     "n_truncated": 0})
        if count:
            self.truncation_policy_counts[policy] += 1
            stats["n_requests"] += 1
        if budget < 1:
            raise ValueError(f"task {task_name}: {what} leaves no room for the prompt; raise max_length "
                             f"(now {self.max_length})")
        if len(content) <= budget:
            return content
        if policy == "error":
            raise ValueError(
                f"task {task_name}: prompt of {len(content) + len(self.prefix)} tokens does not fit: {what}. "
                f"Raise max_length (model_args max_length=...) or set ccq_truncation: middle|left in the "
                f"task's generation_kwargs.")
        cut, truncated = truncate_tokens(content, budget, policy)
        if len(cut) > budget:
            raise RuntimeError(f"truncate_tokens returned {len(cut)} tokens for a budget of {budget}")
        if truncated and count:
            self.n_truncated += 1
            stats["n_truncated"] += 1
        return cut

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

    def _parse_gen_kwargs(self, gen_kwargs: dict[str, Any], task_name: str | None) -> dict[str, Any]:
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
        do_sample = _as_bool(gen_kwargs.get("do_sample", False)) and temperature > 0.0
        eos_text = self.tokenizer.eos_token
        stops = [s for s in until if s] + ([eos_text] if eos_text and eos_text not in until else [])
        return {
            "until": tuple(stops), "max_gen_toks": max_gen_toks, "do_sample": do_sample,
            "temperature": temperature, "top_k": int(gen_kwargs.get("top_k") or 0),
            "top_p": float(gen_kwargs.get("top_p") or 1.0),
            "policy": gen_kwargs.get("ccq_truncation", self.default_truncation),
        }

    def _next_tokens(self, logits: torch.Tensor, settings: dict[str, Any]) -> torch.Tensor:
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
        return torch.multinomial(probs, 1, generator=self._generator).squeeze(-1).to(logits.device)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        prepared: list[tuple[list[int], dict[str, Any]]] = []
        seen: set[int] = set()
        for request in requests:
            first_time = id(request) not in seen
            seen.add(id(request))
            context, gen_kwargs = request.args
            settings = self._parse_gen_kwargs(dict(gen_kwargs or {}), request.task_name)
            budget = self.max_length - settings["max_gen_toks"] - len(self.prefix)
            content = self._fit(self.tok_encode(context), budget, settings["policy"], request.task_name,
                                f"max_length {self.max_length} minus max_gen_toks {settings['max_gen_toks']}",
                                count=first_time)
            prepared.append((self.prefix + content, settings))
        if any(len(ids) == 0 for ids, _ in prepared):
            raise ValueError("generate_until: empty prompt and no BOS token to start from")

        # Batch prompts with identical decoding settings. Without padding, a batch needs one length,
        # except for fla models: each prompt is prefilled alone and their recurrent states are
        # stacked for decoding together (decoding needs no padding).
        def group_key(i: int) -> tuple:
            s = prepared[i][1]
            return (s["until"], s["max_gen_toks"], s["do_sample"], s["temperature"], s["top_k"], s["top_p"])

        groups: dict[tuple, list[int]] = defaultdict(list)
        for i in range(len(prepared)):
            groups[group_key(i)].append(i)
        batches = []
        for indices in groups.values():
            for sub in self._batches([len(prepared[i][0]) for i in indices], any_length=self._stackable):
                batches.append([indices[j] for j in sub])

        results: list[str | None] = [None] * len(requests)
        for batch in tqdm(batches, desc="ccq generate_until", disable=disable_tqdm or self.rank != 0):
            settings = prepared[batch[0]][1]
            texts = self._generate([prepared[i][0] for i in batch], settings)
            for index, text in zip(batch, texts, strict=True):
                results[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return results  # type: ignore[return-value]

    def _decode_graph(self, cache: Any, batch: int) -> Any:
        """The captured decode step for `batch` rows, started from `cache`: captured once per batch
        size and cache layout, then reused by later generate batches (the model must not change in
        between: a graph replays the kernels and weights it captured)."""
        from ccq_eval.graphed_decode import GraphedDecodeStep

        graph = self._decode_graphs.get(batch)
        if graph is not None and graph.matches(cache):
            graph.load(cache)
            return graph
        graph = GraphedDecodeStep(self._backbone, self._lm_head, cache, batch)
        self._decode_graphs[batch] = graph
        return graph

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], settings: dict[str, Any]) -> list[str]:
        """Chunked prefill, then one token per step with the recurrent cache."""
        eos_ids = self._eos_ids()
        stops = settings["until"]
        if len({len(p) for p in prompts}) == 1:
            _, _, logits, cache = self._run(self._tensor(prompts), len(prompts[0]))
        else:  # recurrent fla models only (see generate_until): prefill one by one, decode together
            prefilled = [self._run(self._tensor([p]), len(p)) for p in prompts]
            logits = torch.cat([last for _, _, last, _ in prefilled])
            cache = _stack_caches([c for _, _, _, c in prefilled])
        graphed = None
        if self.cuda_graphs and settings["max_gen_toks"] > 1:
            graphed = self._decode_graph(cache, len(prompts))
        generated: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        self.last_decode_steps = 0  # one-token model calls of this batch (graph replays included)
        for step in range(settings["max_gen_toks"]):
            tokens = self._next_tokens(logits, settings)
            for row, token in enumerate(tokens.tolist()):
                if done[row]:
                    continue
                if token in eos_ids:
                    done[row] = True
                    continue
                generated[row].append(token)
                if stops:
                    tail = self.tok_decode(generated[row])
                    if any(stop in tail for stop in stops):
                        done[row] = True
            if all(done) or step == settings["max_gen_toks"] - 1:
                break
            if graphed is not None:
                logits = graphed(tokens)
            else:
                step_logits, cache = self._forward(tokens.view(-1, 1), cache, 1)
                logits = step_logits[:, -1]
            self.last_decode_steps += 1
        texts = []
        for ids in generated:
            text = self.tok_decode(ids)
            for stop in stops:
                cut = text.find(stop)
                if cut != -1:
                    text = text[:cut]
            texts.append(text)
        return texts
