"""Resuming a unit: an lm-eval LM wrapper that answers known requests from the unit's response
cache and commits new answers chunk by chunk, so a killed run loses at most one chunk.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ccq_eval.harness.store import ResponseCache
from ccq_eval.task_families import DEPTH_KEYS, LENGTH_KEYS


def describe_cell(doc: Any) -> str:
    """'len 2048, depth 50' from an S-NIAH / ppl doc, '' when the doc names no cell."""
    if not isinstance(doc, dict):
        return ""
    parts = []
    for label, keys in (("len", LENGTH_KEYS), ("depth", DEPTH_KEYS)):
        for key in keys:
            if key in doc and doc[key] is not None:
                value = doc[key]
                parts.append(f"{label} {value:g}" if isinstance(value, float) else f"{label} {value}")
                break
    return ", ".join(parts)


# Float subclasses a rolling loglikelihood may return, rebuilt on resume (no pickle: listed here). Imported
# when a cached answer needs it: scoring imports torch.
def _token_nll_type() -> type | None:
    try:
        from ccq_eval.harness.scoring import TokenNLL
    except ImportError:
        return None
    return TokenNLL


def encode_response(request_type: str, response: Any) -> Any:
    if request_type == "generate_until":
        return {"text": str(response)}
    if request_type == "loglikelihood":
        logprob, is_greedy = response
        return {"logprob": float(logprob), "greedy": bool(is_greedy)}
    if request_type == "loglikelihood_rolling":
        encoded: dict[str, Any] = {"logprob": float(response)}
        token_nll = getattr(response, "token_nll", None)
        if token_nll is not None:
            encoded["token_nll"] = [float(x) for x in token_nll]
        return encoded
    raise ValueError(f"unknown lm-eval request type {request_type!r}")


def decode_response(request_type: str, stored: Any) -> Any:
    if request_type == "generate_until":
        return stored["text"]
    if request_type == "loglikelihood":
        return (stored["logprob"], stored["greedy"])
    if request_type == "loglikelihood_rolling":
        if "token_nll" in stored:
            token_nll_type = _token_nll_type()
            if token_nll_type is None:
                raise RuntimeError("cached per-token NLLs need ccq_eval.harness.scoring.TokenNLL, which is missing")
            return token_nll_type(stored["logprob"], stored["token_nll"])  # the stored float exactly
        return stored["logprob"]
    raise ValueError(f"unknown lm-eval request type {request_type!r}")


def request_keys(request_type: str, requests: list[Any]) -> list[str]:
    """Cache keys of a call's requests, computed before the model sees them (an adapter may pop keys
    from gen_kwargs). The n-th repeat of identical arguments (lm-eval's `repeats`, or a sampled
    prompt asked again) gets its own key, so a resumed sampled task keeps every repeat's answer."""
    seen: dict[str, int] = {}
    keys = []
    for request in requests:
        key = ResponseCache.key(request_type, tuple(request.args))
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        keys.append(key if occurrence == 0 else ResponseCache.key(request_type, (*request.args, occurrence)))
    return keys


def _lm_base() -> type:
    from lm_eval.api.model import LM

    return LM


class ResumableLM(_lm_base()):  # type: ignore[misc]
    """Wraps an lm-eval LM: answers known requests from the unit's ResponseCache, sends the
    rest to the model in chunks of `chunk_size`, committing each chunk's responses at once.

    A run killed mid-unit therefore keeps every answered chunk, and the rerun evaluates
    only what is missing. Also reports progress per chunk.
    """

    def __init__(
        self,
        inner: Any,
        cache: ResponseCache,
        *,
        chunk_size: int = 1,
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.cache = cache
        self.chunk_size = max(1, int(chunk_size))
        self.on_progress = on_progress
        self.cached_count = 0
        self.computed_count = 0

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the wrapper lacks: tokenizer_name, get_model_info, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return getattr(self.inner, "rank", 0)

    @property
    def world_size(self) -> int:
        return getattr(self.inner, "world_size", 1)

    @property
    def device(self) -> Any:
        return getattr(self.inner, "device", None)

    # lm-eval's collectives for data-parallel runs (torchrun / accelerate launch): LM defines them
    # as single-process no-ops, so __getattr__ would never reach the adapter's.
    def all_gather(self, tensor: Any) -> Any:
        return self.inner.all_gather(tensor) if hasattr(self.inner, "all_gather") else tensor

    def gather_object(self, obj: Any, dst: int = 0) -> Any:
        return self.inner.gather_object(obj, dst=dst) if hasattr(self.inner, "gather_object") else [obj]

    def barrier(self) -> None:
        if hasattr(self.inner, "barrier"):
            self.inner.barrier()

    def loglikelihood(self, requests: list[Any], **kwargs: Any) -> list[Any]:
        return self._answer("loglikelihood", requests)

    def loglikelihood_rolling(self, requests: list[Any], **kwargs: Any) -> list[Any]:
        return self._answer("loglikelihood_rolling", requests)

    def generate_until(self, requests: list[Any], **kwargs: Any) -> list[Any]:
        return self._answer("generate_until", requests)

    def _answer(self, request_type: str, requests: list[Any]) -> list[Any]:
        keys = request_keys(request_type, requests)
        stored = self.cache.get_many(keys)
        answers: list[Any] = [None] * len(requests)
        pending = []
        for index, key in enumerate(keys):
            if key in stored:
                answers[index] = decode_response(request_type, stored[key])
            else:
                pending.append(index)
        done = len(requests) - len(pending)
        self.cached_count += done
        self._progress(done, len(requests), requests[pending[0]] if pending else None)
        model_method = getattr(self.inner, request_type)
        parameters = inspect.signature(model_method).parameters
        quiet = {"disable_tqdm": True} if "disable_tqdm" in parameters else {}
        # Longest first, so a chunk holds prompts of similar length (scoring batches equal lengths).
        pending.sort(key=lambda i: -len(str(requests[i].args[0])))
        for start in range(0, len(pending), self.chunk_size):
            chunk = pending[start : start + self.chunk_size]
            # A model that takes request_ids (the adapter's generate_until: its sampling seeds) gets each
            # request's key in the whole call, which a chunk of a resumed run cannot recount.
            ids = {"request_ids": [keys[i] for i in chunk]} if "request_ids" in parameters else {}
            outputs = model_method([requests[i] for i in chunk], **quiet, **ids)
            if len(outputs) != len(chunk):
                raise RuntimeError(
                    f"{type(self.inner).__name__}.{request_type} returned {len(outputs)} answers "
                    f"for {len(chunk)} requests"
                )
            self.cache.put_many(
                [(keys[i], encode_response(request_type, out)) for i, out in zip(chunk, outputs)]
            )
            for i, out in zip(chunk, outputs):
                answers[i] = out
            self.computed_count += len(chunk)
            done += len(chunk)
            self._progress(done, len(requests), requests[chunk[-1]])
        return answers

    def _progress(self, done: int, total: int, request: Any) -> None:
        if self.on_progress is not None:
            self.on_progress(done, total, describe_cell(getattr(request, "doc", None)) if request is not None else "")
