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
* truncates prompts only by the policy a task names (`ccq_truncation` in its YAML metadata, or in
  its generation_kwargs: "middle" | "left" | "error", default "error") and counts what it cut.

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

import atexit
import inspect
import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (built-ins first: get_model() only imports them into an empty registry)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ccq_eval.harness.generation import GenerationMixin, as_bool
from ccq_eval.harness.scoring import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK, ScoringMixin, TokenNLL
from ccq_eval.harness.truncation import TRUNCATION_POLICIES, TruncationMixin
from ccq_eval.model.modeling_ccq import prepare_runtime

logger = logging.getLogger(__name__)

# Linear attention has no positional limit; without a user/task value we allow this much.
DEFAULT_MAX_LENGTH = 32768
# batch_size="auto": rows per forward on the fast path (a recurrent fla model on CUDA with graphs),
# where decoding several prompts together is what makes generation fast (one row's decode step
# leaves the GPU idle); 1 elsewhere (CPU, other models, cuda_graphs=False), the eager path as it was.
CUDA_AUTO_BATCH_SIZE = 4

__all__ = ["DEFAULT_MAX_LENGTH", "CCQEvalLM", "TokenNLL"]


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
                      *, model_name: str = "the model") -> tuple[int, bool]:
    """(batch size, CUDA graphs on) from what was asked, None meaning "auto": the fast path (graph
    replay, CUDA_AUTO_BATCH_SIZE rows) for a recurrent fla model on CUDA, eager batch 1 elsewhere and
    when graphs are turned off. cuda_graphs=True where graphs cannot apply is an error, not a silent
    fallback."""
    fits = device_type == "cuda" and recurrent
    if cuda_graphs and not fits:
        raise ValueError("cuda_graphs=True needs a recurrent fla model (GLA / Gated DeltaNet) on a CUDA "
                         f"device; got {model_name} on {device_type}")
    graphs = fits if cuda_graphs is None else cuda_graphs
    return batch_size or (CUDA_AUTO_BATCH_SIZE if graphs else 1), graphs


def end_process_group() -> None:
    """Wait for every rank, then destroy the data-parallel process group (if one is up). The adapter
    registers it with atexit, and `ccq-eval run` calls it after its last unit: left to interpreter
    teardown, gloo's threads can be destroyed while still joinable, which aborts the process with
    SIGABRT after the results are written."""
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank closes its connections while another still uses them
        torch.distributed.destroy_process_group()


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
class CCQEvalLM(ScoringMixin, GenerationMixin, TruncationMixin, LM):
    """lm-eval LM for recurrent causal LMs with chunked, state-carrying scoring.

    Args:
        model: an already-loaded causal LM (HF-style forward with a cache), or None.
        tokenizer: its tokenizer (required with `model`).
        pretrained: name or path for `ccq_eval.model.loading.load_model` (when `model` is None).
        max_length: context budget in tokens (prompt + generated tokens for generation).
            Default DEFAULT_MAX_LENGTH, never the config's max_position_embeddings.
        batch_size: rows per forward; scoring batches only sequences of equal token length
            (no padding: a recurrent state has no attention mask to hide pad tokens); generation
            with a recurrent fla model prefills each prompt alone and decodes up to batch_size
            prompts of any length together. "auto" (the default): CUDA_AUTO_BATCH_SIZE with CUDA
            graphs (see resolve_fast_path), else 1.
        chunk_size: tokens per forward slice when scoring / prefilling.
        logits_chunk: positions whose logits are formed at once (fla models; others: a slice).
        cuda_graphs: replay each one-token decode step (ccq_eval.model.cuda_graphs.decode; one graph per
            batch size, reused by later batches) and each scoring forward that fits one slice
            (ccq_eval.model.cuda_graphs.score) from CUDA graphs; recurrent fla models on CUDA. "auto"
            (the default): on exactly there, eager elsewhere; True refuses other models and devices.
            Graphs hold GPU memory, and scores differ from eager ones by rounding (other matrix
            shapes); False gives the eager path.
        default_truncation: policy for requests that name none (generation whose task declares no
            `ccq_truncation`, and loglikelihood). Default "error".
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
        **kwargs: Any,
    ) -> None:
        super().__init__()
        prepare_runtime()  # the autotune cap and the CCQ model types, before any model is built or used
        ignored = {k: v for k, v in kwargs.items() if k not in ("max_batch_size",)}
        if ignored:
            logger.warning("ccq adapter: ignoring unknown model arguments %s", sorted(ignored))

        self.accelerator = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Launched with `accelerate launch` / torchrun: data-parallel over processes.
            # The evaluator hands each rank its share of the documents.
            from accelerate import Accelerator

            # cpu=True is what makes accelerate use gloo across CPU processes (no CUDA, or the model or
            # device asked for is on the CPU).
            where = device if model is None else next(model.parameters()).device
            on_cpu = not torch.cuda.is_available() or str(where or "").startswith("cpu")
            self.accelerator = Accelerator(cpu=on_cpu)
            self._rank = self.accelerator.process_index
            self._world_size = self.accelerator.num_processes
            atexit.register(end_process_group)

        if model is None:
            if pretrained is None:
                raise ValueError("ccq adapter needs either model=<loaded model> (with tokenizer=) or "
                                 "pretrained=<registry name or path>")
            target = self.accelerator.device if self.accelerator is not None else _resolve_device(device)
            from ccq_eval.model.loading import load_model  # lazy: loading pulls in fla and our models

            model, loaded_tokenizer = load_model(
                str(pretrained), device=str(target), dtype=dtype, allow_pickle=as_bool(allow_pickle),
                trust_remote_code=as_bool(trust_remote_code),
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
        requested_batch_size = _parse_batch_size(batch_size)
        self.chunk_size = int(chunk_size)
        self.logits_chunk = int(logits_chunk)
        if self._max_length < 2 or self.chunk_size < 1 or self.logits_chunk < 1:
            raise ValueError(f"max_length must be >= 2, chunk_size and logits_chunk >= 1; got {max_length}, "
                             f"{chunk_size}, {logits_chunk}")
        if default_truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"default_truncation={default_truncation!r}; valid: {', '.join(TRUNCATION_POLICIES)}")
        self.default_truncation = default_truncation
        self._seed = int(seed)  # with a request's identity, the seed of its sampling (generation.py)

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
        self._batch_size, self.cuda_graphs = resolve_fast_path(
            self._device.type, self._stackable, requested_batch_size, _parse_cuda_graphs(cuda_graphs),
            model_name=type(self.model).__name__)
        self._graphed_scoring = None
        self._decode_graphs: dict[int, Any] = {}  # batch size -> GraphedDecodeStep (see _decode_graph)
        if self.cuda_graphs:
            from ccq_eval.model.cuda_graphs.score import GraphedScoring

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
