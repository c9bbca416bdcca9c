"""Prompt truncation policies applied by the lm-eval adapter before generation.

A task names its policy in ``generation_kwargs["ccq_truncation"]``; the adapter pops it, computes
the prompt budget (model max length minus the task's max new tokens) and calls
:func:`truncate_tokens` on the tokenised prompt.

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

from collections.abc import Sequence

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
            "(set it in the task's generation_kwargs under 'ccq_truncation')"
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
            "shorten the input, or set generation_kwargs ccq_truncation to 'middle' or 'left'"
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
