"""lm-eval model adapter for recurrent (linear-attention) causal LMs, registered as "ccq".

Why not lm-eval's HFLM: it takes max_length from the config (2048 for fla models) and
left-truncates silently, its rolling log-likelihood restarts the state every window, and
it returns one summed number per document. This adapter instead

* scores a whole text in one pass: the model is called on successive slices of
  `chunk_size` tokens with the same cache object, so the recurrent state is carried across
  slices (no disjoint windows, except where a task's published numbers come from HFLM's windows:
  `rolling_windows`, zeroshot.py). For fla models the backbone's hidden states come back and
  the LM head plus fp32 log-softmax run `logits_chunk` positions at a time, so neither the
  logits nor their fp32 copy exist for a whole slice at once (other models: per slice);
* returns per-token NLLs from loglikelihood_rolling (`TokenNLL`);
* scores many short loglikelihood requests in right-padded batches, reading a context that several
  requests share once (multiple choice; short_requests.py);
* decodes with the recurrent cache (chunked prefill, then one token per step);
* truncates prompts only by the policy a task names (`ccq_truncation` in its YAML metadata, or in
  its generation_kwargs: "middle" | "left" | "error", default "error") and counts what it cut.

BOS convention (all request types): when the tokenizer defines a BOS token it is prepended
as unscored context, so every token of the text is scored. When it has none, the first
token of the text is unscored context (rolling in one pass) — except for `loglikelihood` with an
empty context, HFLM's windows and the zero-shot suite's wikitext read in one pass, where EOS serves as the
context token, as lm-eval does.

Use from Python with an already-loaded model:
    CCQEvalLM(model=model, tokenizer=tokenizer, max_length=20480, batch_size=1)
or by name from lm-eval (import this module first so "ccq" is registered):
    simple_evaluate(model="ccq", model_args="pretrained=<name or path>,max_length=20480", ...)
"""
from __future__ import annotations

import atexit
import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (built-ins first: get_model() only imports them into an empty registry)
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ccq_eval.harness.batching import (
    CPU_GENERATION_BATCH,
    CPU_SHORT_SCORING_BATCH,
    PROBE_TOKENS,
    BatchSizer,
    free_memory_bytes,
    measure_row_cost,
)
from ccq_eval.harness.generation import Generator, as_bool
from ccq_eval.harness.model_runtime import ModelRuntime
from ccq_eval.harness.scoring import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK, HFLM_DEFAULT_WINDOW, Scorer, TokenNLL
from ccq_eval.harness.tokens import TokenCodec
from ccq_eval.harness.truncation import Truncator
from ccq_eval.harness.zeroshot import HFLM_ROLLING_TASKS, rolling_protocol
from ccq_eval.model.kernels.token_logprob import token_logprob
from ccq_eval.model.modeling_ccq import prepare_runtime

logger = logging.getLogger(__name__)

# Linear attention has no positional limit; without a user/task value we allow this much.
DEFAULT_MAX_LENGTH = 32768
# The slice size that puts any text through the model in one call (models whose cache takes one token per call).
WHOLE_TEXT = 1 << 62

__all__ = ["DEFAULT_MAX_LENGTH", "CCQEvalLM", "TokenNLL", "hflm_max_length"]


def _parse_batch_size(batch_size: Any) -> int | None:
    """A positive integer, or None for "auto" (resolved once the model and device are known)."""
    if batch_size is None:
        return 1
    if isinstance(batch_size, str):
        if batch_size.startswith("auto"):  # lm-eval's "auto" and "auto:N"
            return None
        if not batch_size.isdigit():
            raise ValueError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
        batch_size = int(batch_size)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return int(batch_size)


def _parse_cuda_graphs(value: bool | str) -> bool | None:
    """True / False, or None for "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    return as_bool(value)


def resolve_fast_path(device_type: str, recurrent: bool, batch_size: int | None, cuda_graphs: bool | None,
                      *, model_name: str = "the model", measured: bool = True) -> tuple[int | None, bool]:
    """(batch size, CUDA graphs on) from what was asked, None meaning "auto". Auto is the fast path
    for a recurrent fla model on CUDA: graph replay, and batch size None, i.e. each batch as many rows
    as free GPU memory holds for its longest request (ccq_eval.harness.batching), where decoding several
    prompts together is what makes generation fast (one row's decode step leaves the GPU idle). Eager
    batch 1 elsewhere (CPU, other models) and when graphs are turned off. cuda_graphs=True where graphs
    cannot apply is an error, not a silent fallback. `measured`: whether the family's fast path has been
    checked against batch 1 on a GPU (families.Family.gpu_fast_path_measured); auto leaves an unmeasured
    family on the eager batch-1 path, cuda_graphs=True still asks for it."""
    fits = device_type == "cuda" and recurrent
    if cuda_graphs and not fits:
        raise ValueError("cuda_graphs=True needs a recurrent fla model on a CUDA device; got "
                         f"{model_name} on {device_type}")
    graphs = (fits and measured) if cuda_graphs is None else cuda_graphs
    return batch_size or (None if graphs else 1), graphs


def end_process_group() -> None:
    """Wait for every rank, then destroy the data-parallel process group (if one is up). The adapter
    registers it with atexit, and `ccq-eval run` calls it after its last unit: left to interpreter
    teardown, gloo's threads can be destroyed while still joinable, which aborts the process with
    SIGABRT after the results are written."""
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank closes its connections while another still uses them
        torch.distributed.destroy_process_group()


def hflm_max_length(model: torch.nn.Module, tokenizer: Any) -> int:
    """The max_length lm-eval's HFLM resolves for this model when given none: its config's n_positions /
    max_position_embeddings / n_ctx, the tokenizer's model_max_length, else 2048."""
    from lm_eval.models.utils import resolve_max_length

    return int(resolve_max_length(getattr(model, "config", None), tokenizer, default=HFLM_DEFAULT_WINDOW))


def _window_tokens(window_tokens: int | str | None, model: torch.nn.Module, tokenizer: Any) -> int:
    """The windows of the HFLM rolling protocol: as given, else hflm_max_length."""
    if window_tokens is not None and str(window_tokens).strip():
        if int(window_tokens) < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        return int(window_tokens)
    return hflm_max_length(model, tokenizer)


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's CLI sends device "cuda:0" by default, also on CPU-only machines.
        logger.warning("device %r requested but CUDA is not available; using cpu", device)
        return torch.device("cpu")
    return torch.device(device)


def _checked_limits(max_length: int | str | None, chunk_size: int | str,
                    logits_chunk: int | str) -> tuple[int, int, int]:
    """(max_length, chunk_size, logits_chunk) as ints; max_length None: DEFAULT_MAX_LENGTH."""
    if max_length is None:
        logger.info("ccq adapter: no max_length given; using %d tokens (linear attention has no "
                    "positional limit; pass max_length=... to set the context budget)", DEFAULT_MAX_LENGTH)
        max_length = DEFAULT_MAX_LENGTH
    limits = int(max_length), int(chunk_size), int(logits_chunk)
    if limits[0] < 2 or limits[1] < 1 or limits[2] < 1:
        raise ValueError(f"max_length must be >= 2, chunk_size and logits_chunk >= 1; got {max_length}, "
                         f"{chunk_size}, {logits_chunk}")
    return limits


@register_model("ccq")
class CCQEvalLM(LM):
    """lm-eval LM for recurrent causal LMs with chunked, state-carrying scoring.

    Built from parts that each own their state: a ModelRuntime (how the model is called), a TokenCodec
    (the tokenizer), a Truncator (context budget, policies and their counts), a Scorer (loglikelihood,
    loglikelihood_rolling) and a Generator (generate_until); the lm-eval methods delegate to them.

    Args:
        model: an already-loaded causal LM (HF-style forward with a cache), or None.
        tokenizer: its tokenizer (required with `model`).
        pretrained: name or path for `ccq_eval.model.loading.load_model` (when `model` is None).
        max_length: context budget in tokens (prompt + generated tokens for generation).
            Default DEFAULT_MAX_LENGTH, never the config's max_position_embeddings.
        batch_size: rows per forward; scoring batches only sequences of equal token length
            (no padding: a recurrent state has no attention mask to hide pad tokens); generation
            with a recurrent fla model prefills each prompt alone and decodes up to batch_size
            prompts of any length together. "auto" (the default): with CUDA graphs (see
            resolve_fast_path), each batch takes as many rows as free GPU memory holds for its longest
            request, a power of two up to batching.AUTO_BATCH_CAP (batching.BatchSizer); on the CPU,
            generation with a recurrent fla model decodes batching.CPU_GENERATION_BATCH prompts together
            and scoring takes one row; else 1.
        chunk_size: tokens per forward slice when scoring / prefilling.
        logits_chunk: positions whose logits are formed at once (fla models; others: a slice).
        cuda_graphs: replay each one-token decode step (ccq_eval.model.cuda_graphs.decode; one graph per
            batch size, reused by later batches) and each scoring forward that fits one slice
            (ccq_eval.model.cuda_graphs.score) from CUDA graphs; recurrent fla models on CUDA. "auto"
            (the default): on exactly there, eager elsewhere; True refuses other models and devices.
            Graphs hold GPU memory, and scores differ from eager ones by rounding (other matrix
            shapes); False gives the eager path.
        default_truncation: policy for requests that name none (generation whose task declares no
            `ccq_truncation`, and loglikelihood). Default "error". For loglikelihood, "left" is lm-eval HFLM's
            cut (Scorer._prepare_loglikelihood); `ccq-eval run` gives it to the zero-shot suite's units.
        rolling_windows: how loglikelihood_rolling scores a text: "hflm" (lm-eval HFLM's disjoint windows of
            `window_tokens`, each read afresh), "carry" (one pass, the state carried), or None (the default):
            per task, HFLM's windows for the zero-shot suite's wikitext, one pass for every other task
            (zeroshot.rolling_protocol). get_model_info() says which protocol scored each task.
        window_tokens: the windows of the "hflm" protocol; default: the max_length HFLM resolves from the
            model's config and tokenizer (lm_eval.models.utils.resolve_max_length), not `max_length`.
        share_contexts: loglikelihood requests with one context (multiple choice) read it once and score
            each continuation from a copy of its state (short_requests.py); False scores each row whole.
            "auto" (the default): on the CPU, where scoring is bound by the positions computed; off on
            CUDA, where a batch of short rows is bound by the host's calls, and whole rows take one
            (graph-replayed) forward per batch against the shared path's two eager ones.
        shared_prefill: with a recurrent fla model, prompts of a generate batch whose lengths differ by a
            few tokens are prefilled together up to the shortest, the longer ones' last tokens fed through
            the first decode steps (generation.prefill_groups): faster for many short prompts, but in half
            precision the recurrent kernel that then reads those tokens can change a greedy answer from
            batch 1's. Default False: each prompt is prefilled alone, on batch 1's kernels.
        device, dtype, allow_pickle, trust_remote_code: passed to load_model.
        seed: for sampling when a task asks for do_sample: each request draws from its own generator,
            seeded by `seed` and the request's identity, so resuming or batching never changes an answer.
        max_batch_size and other lm-eval keyword arguments are accepted and ignored.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        pretrained: str | None = None,
        max_length: int | str | None = None,
        batch_size: int | str | None = "auto",
        chunk_size: int | str = DEFAULT_CHUNK_SIZE,
        logits_chunk: int | str = DEFAULT_LOGITS_CHUNK,
        cuda_graphs: bool | str = "auto",
        default_truncation: str = "error",
        device: str | None = None,
        dtype: str | None = None,
        allow_pickle: bool | str = False,
        trust_remote_code: bool | str = False,
        seed: int | str = 1234,
        rolling_windows: str | None = None,
        window_tokens: int | str | None = None,
        share_contexts: bool | str = "auto",
        shared_prefill: bool | str = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        prepare_runtime()  # the shipped autotune winners and the CCQ model types, before any model is built
        ignored = {k: v for k, v in kwargs.items() if k not in ("max_batch_size",)}
        if ignored:
            logger.warning("ccq adapter: ignoring unknown model arguments %s", sorted(ignored))
        self.accelerator = self._join_data_parallel(model, device)
        model, tokenizer = self._model_and_tokenizer(model, tokenizer, pretrained, device, dtype, allow_pickle,
                                                     trust_remote_code)
        self.runtime = ModelRuntime(model)
        self.model = self.runtime.model
        self.codec = TokenCodec(tokenizer)
        self.pretrained = pretrained if pretrained is not None else getattr(
            getattr(model, "config", None), "_name_or_path", type(model).__name__)
        self._device = self.runtime.device
        max_length, chunk_size, logits_chunk = _checked_limits(max_length, chunk_size, logits_chunk)
        if not self.runtime.sliced_cache:  # a cache that takes one token per call: each text in one forward
            chunk_size, share_contexts = WHOLE_TEXT, False
        self.truncator = Truncator(self.codec, max_length, default_truncation)
        asked_batch_size = _parse_batch_size(batch_size)
        fixed_batch_size, self.cuda_graphs = resolve_fast_path(
            self._device.type, self.runtime.recurrent, asked_batch_size,
            _parse_cuda_graphs(cuda_graphs), model_name=self.runtime.name,
            measured=self.runtime.gpu_fast_path_measured)
        cpu_auto = asked_batch_size is None and self._device.type == "cpu"
        cpu_generation = CPU_GENERATION_BATCH if cpu_auto and self.runtime.recurrent else None
        self.sizer = self._batch_sizer(fixed_batch_size, chunk_size, logits_chunk, cpu_generation,
                                       CPU_SHORT_SCORING_BATCH if cpu_auto else None)
        self.scorer = Scorer(self.runtime, self.codec, self.truncator, chunk_size=chunk_size,
                             logits_chunk=logits_chunk, sizer=self.sizer, cuda_graphs=self.cuda_graphs,
                             rolling_windows=rolling_windows or None,
                             window_tokens=_window_tokens(window_tokens, model, tokenizer),
                             share_contexts=self._device.type == "cpu" if share_contexts == "auto"
                             else as_bool(share_contexts))
        self.generator = Generator(self.runtime, self.scorer, self.codec, self.truncator,
                                   sizer=self.sizer, cuda_graphs=self.cuda_graphs, seed=int(seed),
                                   shared_prefill=as_bool(shared_prefill))

    def _batch_sizer(self, fixed_batch_size: int | None, chunk_size: int, logits_chunk: int,
                     generation_rows: int | None = None, short_rows: int | None = None) -> BatchSizer:
        """Rows per batch: `fixed_batch_size` (generation: `generation_rows`, short loglikelihood rows:
        `short_rows`, when given), or None: sized
        from free memory, the row cost measured on first need by one eager forward of one row of
        PROBE_TOKENS tokens (fewer when chunk_size is), then the LM head and log-probabilities on up to
        `logits_chunk` of its positions, as scoring forms them."""
        device = self._device
        if fixed_batch_size is not None and device.type != "cuda":
            return BatchSizer(fixed_batch_size, chunk_size=chunk_size, generation_rows=generation_rows,
                              short_rows=short_rows)
        probe_tokens = min(PROBE_TOKENS, chunk_size)

        @torch.no_grad()
        def run_body(ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
            # Every position's hidden state kept and the cache built (its state is measured); probe_tokens
            # <= chunk_size: the peak of one slice's forward.
            return self.runtime.forward_features(ids, None, ids.shape[1])

        @torch.no_grad()
        def run_head(hidden: torch.Tensor, ids: torch.Tensor) -> int:
            positions = min(hidden.shape[1] - 1, logits_chunk)
            token_logprob(self.runtime.head(hidden[:, :positions]), ids[:, 1:positions + 1])
            return positions

        # With a fixed batch size the row cost serves only BatchSizer.fits_now (a prefill ahead).
        return BatchSizer(fixed_batch_size, chunk_size=chunk_size, logits_chunk=logits_chunk,
                          generation_rows=generation_rows, short_rows=short_rows,
                          free_memory=lambda: free_memory_bytes(device),
                          measure=lambda: measure_row_cost(run_body, device, probe_tokens,
                                                           self.codec.eot_token_id or 0, head=run_head))

    def _join_data_parallel(self, model: torch.nn.Module | None, device: str | None) -> Any:
        """The Accelerator of a data-parallel launch (`accelerate launch` / torchrun: WORLD_SIZE > 1), with
        this process's rank and the world size set; None for a single process. The evaluator hands each
        rank its share of the documents."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        from accelerate import Accelerator

        # cpu=True is what makes accelerate use gloo across CPU processes (no CUDA, or the model or
        # device asked for is on the CPU).
        where = device if model is None else next(model.parameters()).device
        on_cpu = not torch.cuda.is_available() or str(where or "").startswith("cpu")
        accelerator = Accelerator(cpu=on_cpu)
        self._rank = accelerator.process_index
        self._world_size = accelerator.num_processes
        atexit.register(end_process_group)
        return accelerator

    def _model_and_tokenizer(self, model: torch.nn.Module | None, tokenizer: Any, pretrained: str | None,
                             device: str | None, dtype: str | None, allow_pickle: bool | str,
                             trust_remote_code: bool | str) -> tuple[torch.nn.Module, Any]:
        """The model given, or loaded from `pretrained` (on the data-parallel rank's device), and its
        tokenizer: a tokenizer object given wins over the loaded one."""
        if model is None:
            if pretrained is None:
                raise ValueError("ccq adapter needs either model=<loaded model> (with tokenizer=) or "
                                 "pretrained=<registry name or path>")
            target = self.accelerator.device if self.accelerator is not None else _resolve_device(device)
            from ccq_eval.model.loading import load_model  # lazy: loading pulls in fla and our models

            model, loaded_tokenizer = load_model(str(pretrained), device=str(target), dtype=dtype,
                                                 allow_pickle=as_bool(allow_pickle),
                                                 trust_remote_code=as_bool(trust_remote_code))
            if tokenizer is None or isinstance(tokenizer, str):
                tokenizer = loaded_tokenizer
        elif tokenizer is None or isinstance(tokenizer, str):
            raise ValueError("ccq adapter: model= was given without a tokenizer object (tokenizer=)")
        if self.accelerator is not None:
            model = model.to(self.accelerator.device)
        return model, tokenizer

    # ------------------------------------------------------------------ properties
    @property
    def max_length(self) -> int:
        return self.truncator.max_length

    @property
    def batch_size(self) -> int:
        """The most rows one batch may take: the batch size asked, with auto sizing its cap, and on the
        CPU's auto the rows of a generation batch (CPU_GENERATION_BATCH)."""
        return self.sizer.max_rows

    @property
    def batch_size_auto(self) -> bool:
        """Batches sized from free GPU memory and request lengths (batch_size "auto" on the fast path)."""
        return self.sizer.auto

    @property
    def batch_sizes_run(self) -> Counter[int]:
        """Rows of a batch -> batches that ran with that many (this process, all calls so far)."""
        return self.sizer.used

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer(self) -> Any:
        return self.codec.tokenizer

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    @property
    def bos_token_id(self) -> int | None:
        return self.codec.bos_token_id

    @property
    def eot_token_id(self) -> int:
        return self.codec.eot_token_id

    @property
    def prefix(self) -> list[int]:
        """Unscored context put before every text: [BOS] when the tokenizer has one."""
        return self.codec.prefix

    @property
    def chunk_size(self) -> int:
        return self.scorer.chunk_size

    @property
    def logits_chunk(self) -> int:
        return self.scorer.logits_chunk

    @property
    def default_truncation(self) -> str:
        return self.truncator.default_policy

    @property
    def last_decode_steps(self) -> int:
        """One-token model calls of the last generate batch (graph replays included; for benchmarks)."""
        return self.generator.last_decode_steps

    @property
    def rolling_protocols(self) -> dict[str, str]:
        """Task -> the loglikelihood_rolling protocol ("hflm" / "carry") that scored it (this process)."""
        return dict(self.scorer.rolling_protocols)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval copies into results["config"] after a run: how this adapter scores, so that a table
        can say which rolling protocol produced a perplexity (lm_eval.evaluator.simple_evaluate and
        ccq-eval's runner both call it after evaluating), and the max_length and policy that fit the
        contexts of loglikelihood requests. rolling_protocol_by_task names every task whose rolling requests
        this process scored and, when a protocol was asked (rolling_windows: the runner asks one for each
        unit of the zero-shot suite's wikitext, and only for those), the suite's rolling tasks, also where a
        resumed run scored none of their requests here."""
        asked = self.scorer.rolling_windows
        by_task = {task: rolling_protocol(task, asked) for task in sorted(HFLM_ROLLING_TASKS) if asked is not None}
        return {"ccq_scoring": {"rolling_windows": asked or "per task", "window_tokens": self.scorer.window_tokens,
                                "rolling_protocol_by_task": by_task | self.rolling_protocols,
                                "share_contexts": self.scorer.share_contexts, "max_length": self.max_length,
                                "loglikelihood_truncation": self.default_truncation}}

    def tok_encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    # ------------------------------------------------------------------ lm-eval API
    def _quiet(self, disable_tqdm: bool) -> bool:
        """No progress bar when asked, and on every data-parallel rank but 0."""
        return disable_tqdm or self.rank != 0

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood(requests, self.cache_hook, self._quiet(disable_tqdm))

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[TokenNLL]:
        return self.scorer.loglikelihood_rolling(requests, self.cache_hook, self._quiet(disable_tqdm))

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False,
                       request_ids: list[str] | None = None) -> list[str]:
        """Answers of `requests`. request_ids (resume.request_keys of the whole unit's requests, from the
        resuming wrapper) identify each request for its sampling seed; by default they are computed over
        `requests`."""
        return self.generator.generate_until(requests, self.cache_hook, self._quiet(disable_tqdm), request_ids)

    # ------------------------------------------------------------------ truncation bookkeeping
    @property
    def truncation_policy_counts(self) -> Counter[str]:
        """Policy -> requests that used it (this process)."""
        return self.truncator.policy_counts

    @property
    def n_truncated(self) -> int:
        """Requests whose prompt was cut (this process)."""
        return self.truncator.n_truncated

    @property
    def truncation_by_task(self) -> dict[str, dict[str, Any]]:
        return self.truncator.by_task

    @property
    def truncation_stats(self) -> dict[str, Any]:
        """This process's truncation record: {"policy_counts", "n_truncated", "by_task"}."""
        return self.truncator.stats

    def truncation_summary(self) -> dict[str, Any]:
        """Truncation counts summed over all ranks when data-parallel (collective: call it on every rank);
        the runner copies them into the results metadata."""
        return self.truncator.summary(self.world_size)

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
