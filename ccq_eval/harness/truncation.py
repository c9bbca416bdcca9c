"""Prompt truncation policies applied by the lm-eval adapter before generation.

A task names its policy as ``ccq_truncation`` in its YAML ``metadata`` (our tasks: S-NIAH "error",
LongBench "middle"), where other lm-eval models never see it; a request's
``generation_kwargs["ccq_truncation"]``, where a task puts one, takes precedence. The adapter computes
the prompt budget (model max length minus the task's max new tokens) and fits the tokenised prompt into
it with :class:`Truncator`, which applies :func:`truncate_tokens` and counts what it cut.

Policies
--------
``"middle"``
    LongBench v1's rule (THUDM/LongBench, LongBench/pred.py): when the prompt is longer than the
    budget, ``half = int(budget / 2)`` and the prompt becomes ``ids[:half] + ids[-half:]``. Both
    ends keep the same number of tokens, so an odd budget yields ``budget - 1`` tokens, exactly as
    the official script does. The official script then decodes both halves to text (dropping special
    tokens) and re-tokenises the joined text; this function stays on token ids, so re-tokenising is
    the caller's choice. Keeping both ends preserves the instruction before and the question after
    the context, which left truncation would drop.
``"left"``
    Keep the last ``budget`` tokens (what lm-eval's HFLM does silently).
``"error"``
    Refuse: a prompt longer than the budget raises ``ValueError``. This is the default when a task
    names no policy, so no number is ever produced from a prompt the model did not see whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ccq_eval.harness.task_registry import task_truncation_policy
from ccq_eval.harness.tokens import TokenCodec

VALID_POLICIES: tuple[str, ...] = ("middle", "left", "error")


def truncate_tokens(token_ids: Sequence[int], budget: int, policy: str) -> tuple[list[int], bool]:
    """Fit ``token_ids`` into ``budget`` tokens under ``policy``.

    Returns ``(kept_ids, was_truncated)``; ``kept_ids`` is a new list. A prompt that already fits is
    returned whole with ``was_truncated=False`` under every policy.

    Raises ``ValueError`` for an unknown policy, a budget below 1 (below 2 for "middle") and, under
    "error", a prompt over the budget; ``TypeError`` for a budget that is not an int.
    """
    if policy not in VALID_POLICIES:
        raise ValueError(
            f"unknown truncation policy {policy!r}; valid policies are {', '.join(VALID_POLICIES)} "
            "(set it as 'ccq_truncation' in the task's metadata)"
        )
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"truncation budget must be an int number of tokens, got {budget!r}")
    if budget < 1:
        raise ValueError(
            f"truncation budget is {budget} tokens: the model's max length leaves no room for the prompt "
            "after the task's max new tokens; evaluate with a larger max length"
        )

    ids = list(token_ids)
    n_tokens = len(ids)
    if n_tokens <= budget:
        return ids, False

    if policy == "error":
        raise ValueError(
            f"prompt is {n_tokens} tokens but the budget is {budget} tokens (model max length minus max "
            "new tokens) and the truncation policy is 'error'; evaluate with a larger max length, "
            "shorten the input, or set the task's metadata ccq_truncation to 'middle' or 'left'"
        )
    if policy == "left":
        return ids[-budget:], True

    # "middle": LongBench pred.py keeps int(max_length / 2) tokens from each end.
    half = budget // 2
    if half == 0:
        # ids[-0:] would be the whole prompt; the official rule needs at least one token per end.
        raise ValueError(
            f"middle truncation needs a budget of at least 2 tokens, got {budget}; "
            "evaluate with a larger max length or use policy 'left'"
        )
    return ids[:half] + ids[-half:], True


TRUNCATION_POLICIES = VALID_POLICIES
# A UTF-8 character is at most 4 bytes: a byte-level tokenizer's cut is at most 3 tokens from a boundary.
_CHARACTER_TOKENS = 4


class Truncator:
    """Prompt fitting for the adapter: the context budget (`max_length` tokens), the policy of requests
    that name none (`default_policy`), and per-task bookkeeping of how many prompts each policy cut
    (the runner copies it into the results metadata)."""

    def __init__(self, codec: TokenCodec, max_length: int, default_policy: str = "error") -> None:
        if default_policy not in TRUNCATION_POLICIES:
            raise ValueError(f"default_truncation={default_policy!r}; "
                             f"valid: {', '.join(TRUNCATION_POLICIES)}")
        self.codec = codec
        self.max_length = max_length
        self.default_policy = default_policy
        self.policy_counts: Counter[str] = Counter()  # policy -> requests that used it
        self.n_truncated = 0  # requests whose prompt was cut
        self.by_task: dict[str, dict[str, Any]] = {}

    @property
    def stats(self) -> dict[str, Any]:
        """This process's truncation record: {"policy_counts", "n_truncated", "by_task"}."""
        return {"policy_counts": dict(self.policy_counts), "n_truncated": self.n_truncated,
                "by_task": {task: dict(stats) for task, stats in self.by_task.items()}}

    def summary(self, world_size: int) -> dict[str, Any]:
        """Truncation counts of this process, summed over all `world_size` ranks when data-parallel
        (collective: call it on every rank). Returns {"policy_counts", "n_truncated", "by_task"}."""
        local = self.stats
        if world_size <= 1:
            return local
        import torch.distributed

        parts = [None] * world_size
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

    def _middle_at_characters(self, content: list[int], half: int) -> list[int]:
        """`content[:half] + content[-half:]` with the head ending and the tail starting on a character
        boundary (up to 3 tokens fewer each, down to an empty head or tail when the half is shorter than
        a character): with a byte-level tokenizer the halves' partial bytes would otherwise join into a
        character that is not in the source. The official script decodes each half, which drops the same
        partial bytes. Cuts that round-trip nowhere nearby stay as they are."""
        n_tokens = len(content)
        whole = self.codec.whole_characters
        head = next((end for end in range(half, max(half - _CHARACTER_TOKENS, -1), -1)
                     if whole(content[:end])), half)
        last_start = min(n_tokens - half + _CHARACTER_TOKENS - 1, n_tokens)
        tail = next((start for start in range(n_tokens - half, last_start + 1)
                     if whole(content[start:])), n_tokens - half)
        return content[:head] + content[tail:]

    def policy_of(self, gen_kwargs: dict[str, Any], task_name: str | None) -> str:
        """The truncation policy of a generation request: its generation_kwargs' `ccq_truncation`, else its
        task's metadata `ccq_truncation` (task_registry.task_truncation_policy), else the default policy."""
        if "ccq_truncation" in gen_kwargs:
            return gen_kwargs["ccq_truncation"]
        return task_truncation_policy(task_name) or self.default_policy

    def cut(self, content: list[int], budget: int, policy: str, task_name: str | None,
            what: str) -> tuple[list[int], bool]:
        """`content` fitted into `budget` tokens under `policy`, and whether anything was cut. Counts
        nothing and changes nothing, so that many prompts may be cut at once on threads (count() after)."""
        if policy not in TRUNCATION_POLICIES:
            raise ValueError(f"ccq_truncation={policy!r} (task {task_name}); valid: {', '.join(TRUNCATION_POLICIES)}")
        if budget < 1:
            needed = self.max_length - budget  # the task's new tokens (and BOS)
            raise ValueError(f"task {task_name}: {what} leaves no room for the prompt; this task needs a max "
                             f"length above {needed} (e.g. --max-length {needed + 2048}, or model_args "
                             f"max_length=...), now {self.max_length}")
        if len(content) <= budget:
            return content, False
        if policy == "error":
            raise ValueError(
                f"task {task_name}: prompt of {len(content) + len(self.codec.prefix)} tokens does not fit: "
                f"{what}. Raise max_length (model_args max_length=...) or set ccq_truncation: middle|left in "
                f"the task's metadata.")
        kept, truncated = truncate_tokens(content, budget, policy)
        if truncated and policy == "middle":
            kept = self._middle_at_characters(content, len(kept) // 2)
        if len(kept) > budget:
            raise RuntimeError(f"truncate_tokens returned {len(kept)} tokens for a budget of {budget}")
        return kept, truncated

    def count(self, policy: str, task_name: str | None, truncated: bool) -> None:
        """Record one request of `task_name` under `policy`, and whether its prompt was cut."""
        stats = self.by_task.setdefault(str(task_name), {"policy": policy, "n_requests": 0, "n_truncated": 0})
        self.policy_counts[policy] += 1
        stats["n_requests"] += 1
        if truncated:
            self.n_truncated += 1
            stats["n_truncated"] += 1

    def fit(self, content: list[int], budget: int, policy: str, task_name: str | None,
            what: str, count: bool = True) -> list[int]:
        """cut() and count() in one: `count` False for a repeated Instance (lm-eval's data-parallel
        padding and `repeats` reuse one)."""
        kept, truncated = self.cut(content, budget, policy, task_name, what)
        if count:
            self.count(policy, task_name, truncated)
        return kept
