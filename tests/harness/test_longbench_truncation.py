"""ccq_eval.harness.truncation: the middle / left / error policies."""

import pytest

from ccq_eval.harness.truncation import VALID_POLICIES, truncate_tokens


def test_valid_policies():
    assert set(VALID_POLICIES) == {"middle", "left", "error"}


@pytest.mark.parametrize("policy", ["middle", "left", "error"])
def test_prompt_within_budget_is_untouched(policy):
    ids = list(range(10))
    kept, truncated = truncate_tokens(ids, 10, policy)
    assert kept == ids and truncated is False
    kept, truncated = truncate_tokens(ids, 50, policy)
    assert kept == ids and truncated is False
    assert kept is not ids  # a new list: the caller may mutate it


def test_middle_keeps_first_and_last_halves_even_budget():
    ids = list(range(100, 120))  # 20 tokens
    kept, truncated = truncate_tokens(ids, 8, "middle")
    # LongBench pred.py: half = int(8 / 2) = 4 -> ids[:4] + ids[-4:]
    assert kept == [100, 101, 102, 103, 116, 117, 118, 119]
    assert truncated is True


def test_middle_odd_budget_follows_official_rule():
    ids = list(range(20))
    kept, truncated = truncate_tokens(ids, 7, "middle")
    # half = int(7 / 2) = 3 from each end: 6 tokens, one below the budget, as in pred.py
    assert kept == [0, 1, 2, 17, 18, 19]
    assert truncated is True


def test_middle_one_over_budget():
    ids = list(range(9))
    kept, _ = truncate_tokens(ids, 8, "middle")
    assert kept == [0, 1, 2, 3, 5, 6, 7, 8]  # only the middle token (4) is dropped


def test_middle_budget_one_is_refused():
    # int(1 / 2) = 0 and ids[-0:] is the whole list in Python: refuse instead of returning everything
    with pytest.raises(ValueError, match="at least 2"):
        truncate_tokens(list(range(5)), 1, "middle")


def test_left_keeps_last_tokens():
    ids = list(range(20))
    kept, truncated = truncate_tokens(ids, 5, "left")
    assert kept == [15, 16, 17, 18, 19] and truncated is True
    kept, _ = truncate_tokens(ids, 1, "left")
    assert kept == [19]


def test_error_policy_names_length_budget_and_remedy():
    with pytest.raises(ValueError) as info:
        truncate_tokens(list(range(30)), 12, "error")
    message = str(info.value)
    assert "30 tokens" in message and "12 tokens" in message
    assert "middle" in message and "left" in message and "max length" in message


def test_unknown_policy_lists_valid_ones():
    with pytest.raises(ValueError, match="middle, left, error"):
        truncate_tokens([1, 2, 3], 2, "right")


@pytest.mark.parametrize("budget", [0, -3])
def test_budget_without_room(budget):
    with pytest.raises(ValueError, match="budget"):
        truncate_tokens([1, 2, 3], budget, "left")


@pytest.mark.parametrize("budget", [2.5, True, "8"])
def test_budget_must_be_int(budget):
    with pytest.raises(TypeError, match="budget"):
        truncate_tokens([1, 2, 3], budget, "left")


def test_accepts_tuple_and_returns_list():
    kept, truncated = truncate_tokens((5, 6, 7, 8), 2, "middle")
    assert kept == [5, 8] and truncated is True
