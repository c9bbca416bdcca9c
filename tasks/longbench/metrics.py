"""LongBench v1 metrics, written for this project from the definitions in THUDM/LongBench
(commit 2e00731f8d0bff23dc4325161044d0ed8af94c1e, LongBench/metrics.py and LongBench/eval.py).

Every metric takes ``(prediction, ground_truth, *, all_classes=None)`` and returns a value in [0, 1];
eval.py scores a sample as the max over its gold answers and a dataset as the mean x 100.

Dependencies: the standard library, numpy (an lm-eval dependency; ROUGE-L's long tables) and jieba for
the two Chinese metrics (imported on first use). LongBench's own code uses the `rouge` package
(ROUGE-L) and `fuzzywuzzy` (fuzz.ratio); both are re-implemented here with the same algorithms,
tie-breaking and rounding, see rouge_l_f and fuzz_ratio.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from difflib import SequenceMatcher
from types import ModuleType

# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

_ASCII_PUNCTUATION = frozenset(string.punctuation)
# The Chinese punctuation set of LongBench's normalize_zh_answer, character for character (it has
# "》" but not "《", and ends with an ASCII "."): a fact of the reference, kept as is.
_ZH_EXTRA_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ZH_PUNCTUATION = _ASCII_PUNCTUATION | frozenset(_ZH_EXTRA_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation, in LongBench's order: lower-case, drop ASCII punctuation, replace the
    articles a/an/the by spaces, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """LongBench's Chinese normalisation: lower-case, drop ASCII and Chinese punctuation, delete all
    whitespace (no article removal)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


# ---------------------------------------------------------------------------------------------
# jieba, loaded on first use only
# ---------------------------------------------------------------------------------------------

_jieba_module: ModuleType | None = None

JIEBA_MISSING_MESSAGE = (
    "LongBench's Chinese metrics (qa_f1_zh_score for multifieldqa_zh, rouge_zh_score for dureader and "
    "vcsum) tokenise with jieba, which is not installed: run `pip install jieba` (pure Python), or "
    "leave the Chinese datasets out"
)


def load_jieba() -> ModuleType:
    """Import jieba once (it builds its prefix dictionary lazily on the first cut)."""
    global _jieba_module
    if _jieba_module is None:
        try:
            import jieba
        except ImportError as err:
            raise ImportError(JIEBA_MISSING_MESSAGE) from err
        import logging

        jieba.setLogLevel(logging.WARNING)  # silence "Building prefix dict" chatter; no effect on cuts
        _jieba_module = jieba
    return _jieba_module


def jieba_words(text: str) -> list[str]:
    """Accurate-mode jieba segmentation with HMM, as LongBench calls it (jieba.cut(text, cut_all=False))."""
    return list(load_jieba().cut(text, cut_all=False))


# ---------------------------------------------------------------------------------------------
# Token F1
# ---------------------------------------------------------------------------------------------


def token_f1(prediction_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap), 0 when nothing overlaps."""
    overlap = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Token F1 after SQuAD normalisation, tokens split on whitespace."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Token F1 over jieba words, each word normalised and empty words dropped."""

    def words(text: str) -> list[str]:
        normalised = (normalize_zh_answer(word) for word in jieba_words(text))
        return [word for word in normalised if word]

    return token_f1(words(prediction), words(ground_truth))


# ---------------------------------------------------------------------------------------------
# ROUGE-L F, as computed by the `rouge` package (pltrdy, 1.0.1) that LongBench calls
# ---------------------------------------------------------------------------------------------
# rouge.Rouge().get_scores([pred], [gold], avg=True)["rouge-l"]["f"] computes summary-level ROUGE-L
# with "exclusive" (set-based) counting:
#   * a text is split into sentences on "." (empty pieces dropped, whitespace inside each piece
#     collapsed to single spaces), a sentence into words on " " (so a whitespace-only piece
#     contributes one empty word);
#   * m / n = number of DISTINCT words of the reference / the prediction;
#   * the overlap is the number of distinct words in the union, over every (reference sentence,
#     prediction sentence) pair, of the words of one longest common subsequence, reconstructed by
#     the package's traceback (match -> diagonal; else up if the cell above is strictly larger,
#     otherwise left), which decides which LCS is taken when several exist;
#   * f = 2 * p * r / (p + r + 1e-8) with p = overlap / n and r = overlap / m.
# An empty sentence list makes the package raise; LongBench catches every exception and scores 0.0.
# Deliberate difference: the package reconstructs the LCS recursively, so a sentence pair longer
# than Python's recursion limit (~1000 words together) raises RecursionError and LongBench scores
# 0.0; the traceback below is iterative and returns the real value.


def _rouge_sentences(text: str) -> list[str]:
    return [" ".join(piece.split()) for piece in text.split(".") if piece]


# Above this many table cells the LCS rows are filled with numpy (a 512-token summary against a
# reference of several hundred words is ~10^5 cells: ~0.1 s in pure Python per sample).
_NUMPY_LCS_CELLS = 4096


def _lcs_table(reference_words: Sequence[str], prediction_words: Sequence[str]) -> Sequence[Sequence[int]]:
    """table[i][j] = LCS length of reference_words[:i] and prediction_words[:j] (lists for a small table,
    a numpy array for a large one)."""
    rows, cols = len(reference_words), len(prediction_words)
    if rows * cols <= _NUMPY_LCS_CELLS:
        table = [[0] * (cols + 1) for _ in range(rows + 1)]
        for i in range(1, rows + 1):
            ref_word = reference_words[i - 1]
            above, here = table[i - 1], table[i]
            for j in range(1, cols + 1):
                if ref_word == prediction_words[j - 1]:
                    here[j] = above[j - 1] + 1
                else:
                    here[j] = max(above[j], here[j - 1])
        return table
    # The same recurrence a row at a time: a match gives above[j - 1] + 1, which is never below
    # here[j - 1] (adjacent LCS lengths differ by at most one), so a row is the running maximum of
    # (above[j - 1] + 1 where the words match, above[j] elsewhere).
    import numpy as np

    ids: dict[str, int] = {}
    prediction_ids = np.array([ids.setdefault(word, len(ids)) for word in prediction_words])
    table_array = np.zeros((rows + 1, cols + 1), dtype=np.int64)
    for i, ref_word in enumerate(reference_words, start=1):
        above = table_array[i - 1]
        candidate = above[1:].copy()
        matches = prediction_ids == ids.get(ref_word, -1)
        candidate[matches] = above[:-1][matches] + 1
        np.maximum.accumulate(candidate, out=table_array[i, 1:])
    return table_array


def _lcs_words(reference_words: Sequence[str], prediction_words: Sequence[str]) -> set[str]:
    """Words of the longest common subsequence chosen by the `rouge` package's traceback."""
    rows, cols = len(reference_words), len(prediction_words)
    table = _lcs_table(reference_words, prediction_words)
    words: set[str] = set()
    i, j = rows, cols
    while i > 0 and j > 0:
        if reference_words[i - 1] == prediction_words[j - 1]:
            words.add(reference_words[i - 1])
            i -= 1
            j -= 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_f(prediction: str, reference: str) -> float:
    """ROUGE-L F of the `rouge` package (see the block comment above)."""
    prediction_sentences = _rouge_sentences(prediction)
    reference_sentences = _rouge_sentences(reference)
    if not prediction_sentences or not reference_sentences:
        return 0.0
    split_prediction = [sentence.split(" ") for sentence in prediction_sentences]
    split_reference = [sentence.split(" ") for sentence in reference_sentences]
    distinct_reference = len({word for sentence in split_reference for word in sentence})
    distinct_prediction = len({word for sentence in split_prediction for word in sentence})
    union: set[str] = set()
    for reference_words in split_reference:
        for prediction_words in split_prediction:
            union |= _lcs_words(reference_words, prediction_words)
    recall = len(union) / distinct_reference
    precision = len(union) / distinct_prediction
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def rouge_score(prediction: str, ground_truth: str, **_: object) -> float:
    return rouge_l_f(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, **_: object) -> float:
    """ROUGE-L F over jieba words joined by spaces."""
    return rouge_l_f(" ".join(jieba_words(prediction)), " ".join(jieba_words(ground_truth)))


# ---------------------------------------------------------------------------------------------
# Classification, retrieval, counting
# ---------------------------------------------------------------------------------------------


def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None,
                         **_: object) -> float:
    """1 / (number of matched classes) when the gold class is among the classes found in the
    prediction (substring match), else 0. A matched class that is a strict substring of the gold
    class is discarded, with LongBench's iteration quirk reproduced (see below)."""
    if all_classes is None:
        raise ValueError("classification_score needs the record's all_classes list (it is null)")
    matched = [name for name in all_classes if name in prediction]
    # LongBench removes entries from the list while a for-loop walks it, so the entry right after each
    # removed one is never examined. The explicit index below walks the list the same way.
    position = 0
    while position < len(matched):
        name = matched[position]
        position += 1
        if name in ground_truth and name != ground_truth:
            matched.remove(name)
    if ground_truth in matched:
        return 1.0 / len(matched)
    return 0.0


def _fraction_equal(numbers: list[str], target: str) -> float:
    if not numbers:
        return 0.0
    return sum(number == target for number in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Share of the integers in the prediction that equal the gold count."""
    return _fraction_equal(re.findall(r"\d+", prediction), str(ground_truth))


def _paragraph_id(ground_truth: str, pattern: str) -> str:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"gold answer {ground_truth!r} has no paragraph number matching {pattern!r}")
    return found[0]


# The paragraph number of a retrieval gold answer ("Paragraph 3", "段落3"), per metric.
PARAGRAPH_PATTERNS = {"retrieval_score": r"Paragraph (\d+)", "retrieval_zh_score": r"段落(\d+)"}


def retrieval_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Share of the integers in the prediction that equal N of the gold "Paragraph N"."""
    return _fraction_equal(re.findall(r"\d+", prediction),
                           _paragraph_id(ground_truth, PARAGRAPH_PATTERNS["retrieval_score"]))


def retrieval_zh_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Share of the integers in the prediction that equal N of the gold "段落N"."""
    return _fraction_equal(re.findall(r"\d+", prediction),
                           _paragraph_id(ground_truth, PARAGRAPH_PATTERNS["retrieval_zh_score"]))


# ---------------------------------------------------------------------------------------------
# Code similarity
# ---------------------------------------------------------------------------------------------


def fuzz_ratio(first: str, second: str) -> int:
    """fuzzywuzzy 0.18's fuzz.ratio without python-Levenshtein (LongBench's requirements do not install
    it): 100 for equal strings, 0 if either is empty, else round(100 * difflib ratio) with Python's
    round and SequenceMatcher's default autojunk heuristic."""
    if first == second:
        return 100
    if not first or not second:
        return 0
    return round(100 * SequenceMatcher(None, first, second).ratio())


def first_code_line(prediction: str) -> str:
    """First line (after leading newlines) holding no backtick, '#' or '//'; '' if there is none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, **_: object) -> float:
    return fuzz_ratio(first_code_line(prediction), ground_truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}


def first_line(prediction: str) -> str:
    """eval.py's cut for trec/triviaqa/samsum/lsht: drop leading newlines, keep the first line."""
    return prediction.lstrip("\n").split("\n")[0]


def best_score(metric_name: str, prediction: str, answers: Sequence[str],
               all_classes: Sequence[str] | None = None) -> float:
    """Max of the metric over the gold answers (0.0 when there are none), in [0, 1]."""
    metric = METRICS[metric_name]
    best = 0.0
    for answer in answers:
        best = max(best, float(metric(prediction, answer, all_classes=all_classes)))
    return best
