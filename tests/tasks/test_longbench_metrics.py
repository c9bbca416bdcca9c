"""LongBench metrics (tasks/longbench/metrics.py) against hand-computed values of the official
definitions (THUDM/LongBench metrics.py / eval.py), plus optional cross-checks against the packages
LongBench itself calls (`rouge`, `fuzzywuzzy`) when they are installed."""

import importlib
import random
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    return importlib.import_module(f"ccq_eval.tasks.longbench.{name}")


m = _load("metrics")
utils = _load("utils")


def approx(value):
    return pytest.approx(value, abs=1e-9)


# --------------------------------------------------------------------------------- qa_f1 (English)


def test_qa_f1_normalisation_makes_exact_match():
    # "The Penn Treebank." -> lower, drop ".", drop article -> "penn treebank" == gold
    assert m.qa_f1_score("The Penn Treebank.", "Penn Treebank") == 1.0
    # punctuation is deleted, not spaced: "U.S.A." -> "usa"
    assert m.qa_f1_score("U.S.A.", "USA") == 1.0


def test_qa_f1_partial():
    # pred tokens: labeled f1 score on test set (6, "the" removed); gold: labeled f1 (2)
    # overlap 2: P = 2/6, R = 2/2 -> F1 = 2 * (1/3) * 1 / (4/3) = 0.5
    assert m.qa_f1_score("labeled F1 score on the test set", "labeled F1") == approx(0.5)
    # multiset overlap: pred paris paris france vs gold paris -> overlap 1, P = 1/3, R = 1 -> 0.5
    assert m.qa_f1_score("Paris paris France", "Paris") == approx(0.5)
    # articles are removed only as whole words: "another theater" keeps both tokens
    # P = 1/2, R = 1 -> F1 = 2/3
    assert m.qa_f1_score("another theater", "theater") == approx(2 / 3)


def test_qa_f1_no_overlap_and_empty():
    assert m.qa_f1_score("Berlin", "Paris") == 0.0
    assert m.qa_f1_score("", "Paris") == 0.0
    assert m.qa_f1_score("the.", "Paris") == 0.0  # normalises to nothing


def test_best_score_is_max_over_answers():
    # vs "Mediterranean Sea": P = 1, R = 1/2 -> 2/3; vs "Mediterranean": 1 -> max 1
    assert m.best_score("qa_f1_score", "Mediterranean", ["Mediterranean Sea", "Mediterranean"]) == 1.0
    assert m.best_score("qa_f1_score", "Mediterranean", ["Mediterranean Sea"]) == approx(2 / 3)
    assert m.best_score("qa_f1_score", "anything", []) == 0.0


# --------------------------------------------------------------------------------- Chinese (jieba)


def test_qa_f1_zh():
    # jieba 0.42.1 accurate mode: 阿尔德/大桥/于/1932/年/建成/。 ; gold 1932/年
    assert m.jieba_words("阿尔德大桥于1932年建成。") == ["阿尔德", "大桥", "于", "1932", "年", "建成", "。"]
    assert m.jieba_words("1932年") == ["1932", "年"]
    # "。" normalises to "" and is dropped: 6 pred words, 2 gold, overlap 2 -> P = 1/3, R = 1 -> 0.5
    assert m.qa_f1_zh_score("阿尔德大桥于1932年建成。", "1932年") == approx(0.5)
    # 历时/四年 vs 四年: P = 1/2, R = 1 -> 2/3
    assert m.qa_f1_zh_score("历时四年", "四年") == approx(2 / 3)
    assert m.qa_f1_zh_score("四年。", "四年") == 1.0
    assert m.qa_f1_zh_score("北京", "四年") == 0.0


def test_rouge_zh():
    pred, gold = "会议决定下周测试系统", "会议决定下周开始测试新系统。"
    assert m.jieba_words(pred) == ["会议", "决定", "下周", "测试", "系统"]
    assert m.jieba_words(gold) == ["会议", "决定", "下周", "开始", "测试", "新", "系统", "。"]
    # one "sentence" each (no ASCII "."); distinct words: pred 5, gold 8; LCS = the 5 pred words
    # P = 5/5, R = 5/8 -> F = 2 * (5/8) / (1 + 5/8 + 1e-8) = 10/13 (minus the 1e-8 smoothing)
    assert m.rouge_zh_score(pred, gold) == pytest.approx(2 * (5 / 8) / (1 + 5 / 8 + 1e-8), abs=1e-12)
    assert m.rouge_zh_score(pred, gold) == pytest.approx(10 / 13, abs=1e-7)


# --------------------------------------------------------------------------------- ROUGE-L


def _f(p, r):
    return 2.0 * (p * r / (p + r + 1e-8))  # the rouge package's smoothing term


def test_rouge_l_single_sentence_counts_distinct_words():
    # pred words: the cat sat on the mat (distinct: the cat sat on mat = 5)
    # gold words: the cat is on the mat (distinct: the cat is on mat = 5)
    # LCS "the cat on the mat" -> distinct words {the, cat, on, mat} = 4 -> P = R = 4/5 -> F ~ 0.8
    # (a per-token ROUGE-L, e.g. Google's rouge_score, would say 5/6 here: the package is set-based)
    assert m.rouge_l_f("the cat sat on the mat", "the cat is on the mat") == approx(_f(0.8, 0.8))
    assert m.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-7)


def test_rouge_l_summary_level_union():
    # sentences split on ".": pred [a b c] [d e], gold [a c d] [e f g]
    # (gold1, pred1) -> LCS a c; (gold1, pred2) -> d; (gold2, pred1) -> none; (gold2, pred2) -> e
    # union {a, c, d, e} = 4; distinct pred words 5, gold 6 -> P = 4/5, R = 4/6 -> F = 8/11
    assert m.rouge_l_f("a b c. d e", "a c d. e f g") == approx(_f(4 / 5, 4 / 6))
    assert m.rouge_l_f("a b c. d e", "a c d. e f g") == pytest.approx(8 / 11, abs=1e-7)


def test_rouge_l_traceback_tie_break():
    # gold [a b] vs pred sentence [b a]: two LCS of length 1; the package's traceback takes "b"
    # (left move on ties). With the second pred sentence [a] the union is {a, b}: P = R = 1.
    # Taking "a" instead would give union {a}, F = 0.5.
    assert m.rouge_l_f("b a. a", "a b") == approx(_f(1.0, 1.0))


def test_rouge_l_empty_inputs_score_zero():
    # the package raises on an empty sentence list; LongBench catches it and scores 0.0
    assert m.rouge_l_f("", "a summary") == 0.0
    assert m.rouge_l_f("...", "a summary") == 0.0
    assert m.rouge_l_f("a summary", "") == 0.0


def test_rouge_l_numpy_rows_equal_the_python_table(monkeypatch):
    """Past _NUMPY_LCS_CELLS the LCS table is filled a row at a time with numpy: the same table, so the
    same traceback, words and score as the cell-by-cell loop, on long summaries with many repeated words
    (ties), several sentences and pairs with no common word."""
    rng = random.Random(7)
    pairs = []
    for vocabulary, n_pred, n_gold in ((6, 300, 500), (40, 450, 700), (2000, 200, 300), (3, 70, 80)):
        words = [f"w{i}" for i in range(vocabulary)]

        def text(n, words=words):
            return " ".join(rng.choice(words) + ("." if rng.random() < 0.02 else "") for _ in range(n))

        pairs.append((text(n_pred), text(n_gold)))
    pairs.append(("x " * 300, "y " * 300))  # nothing in common
    with_numpy = [m.rouge_l_f(pred, gold) for pred, gold in pairs]
    tables = [m._lcs_table(gold.split(), pred.split()) for pred, gold in pairs]
    monkeypatch.setattr(m, "_NUMPY_LCS_CELLS", 10**9)
    assert [m.rouge_l_f(pred, gold) for pred, gold in pairs] == with_numpy
    for (pred, gold), table in zip(pairs, tables, strict=True):
        assert [list(row) for row in table] == m._lcs_table(gold.split(), pred.split())
    assert min(with_numpy[:4]) > 0 and with_numpy[4] == 0.0


def test_rouge_l_long_sentence_no_recursion_limit():
    # 1,500 identical words in one sentence: the package's recursive traceback would overflow;
    # ours returns the real value. Distinct words: w0..w1499 -> P = R = 1.
    text = " ".join(f"w{i}" for i in range(1500))
    assert m.rouge_l_f(text, text) == approx(_f(1.0, 1.0))


# --------------------------------------------------------------------------------- classification


TREC = ["Abbreviation", "Animal", "Color", "Date", "City", "Number of something"]


def test_classification_basic():
    assert m.classification_score("Color", "Color", all_classes=TREC) == 1.0
    # two classes found, gold among them -> 1/2
    assert m.classification_score("Color or Date", "Color", all_classes=TREC) == 0.5
    assert m.classification_score("Date", "Color", all_classes=TREC) == 0.0
    assert m.classification_score("no class here", "Color", all_classes=TREC) == 0.0


def test_classification_drops_substrings_of_gold_with_official_quirk():
    classes = ["a", "ab", "abc", "abcd"]
    # all four occur in "abcd". LongBench removes classes that are strict substrings of the gold
    # while iterating the same list: "a" is removed, the iterator then skips "ab" and removes "abc",
    # and stops. Left: [ab, abcd] -> 1/2 (a clean filter would leave [abcd] -> 1.0).
    assert m.classification_score("abcd", "abcd", all_classes=classes) == 0.5
    # a single substring class is removed cleanly: "Number" in gold "Number of something"
    classes = ["Number", "Number of something", "Date"]
    assert m.classification_score("Number of something", "Number of something", all_classes=classes) == 1.0


def test_classification_needs_classes():
    with pytest.raises(ValueError, match="all_classes"):
        m.classification_score("Color", "Color", all_classes=None)


# --------------------------------------------------------------------------------- retrieval, count


def test_retrieval_score():
    assert m.retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    # numbers found: 2, 12 -> one of two equals 2
    assert m.retrieval_score("Paragraph 2 or Paragraph 12", "Paragraph 2") == 0.5
    assert m.retrieval_score("The answer is Paragraph 3", "Paragraph 2") == 0.0
    assert m.retrieval_score("no idea", "Paragraph 2") == 0.0
    with pytest.raises(ValueError, match="paragraph number"):
        m.retrieval_score("2", "the second one")


def test_retrieval_zh_score():
    assert m.retrieval_zh_score("段落2", "段落2") == 1.0
    assert m.retrieval_zh_score("答案是段落2，不是段落3", "段落2") == 0.5
    assert m.retrieval_zh_score("Paragraph 2", "段落2") == 1.0  # only the digits of the prediction count


def test_count_score():
    assert m.count_score("There are 3 unique paragraphs", "3") == 1.0
    assert m.count_score("3 or 4", "3") == 0.5
    assert m.count_score("33", "3") == 0.0  # whole numbers, not digits
    assert m.count_score("none", "3") == 0.0


# --------------------------------------------------------------------------------- code similarity


def test_fuzz_ratio_rounding():
    # difflib ratio = 2M / T. "int x = 1;" vs "int y = 1;": M = 9, T = 20 -> 90
    assert m.fuzz_ratio("int x = 1;", "int y = 1;") == 90
    # M = 7, T = 16 -> 87.5 -> round half to even -> 88
    assert m.fuzz_ratio("return x", "return y") == 88
    # M = 1, T = 80 -> 2.5 -> round half to even -> 2
    assert m.fuzz_ratio("a" + "b" * 39, "a" + "c" * 39) == 2
    assert m.fuzz_ratio("", "") == 100  # equality is checked before emptiness, as in fuzzywuzzy
    assert m.fuzz_ratio("", "x") == 0


def test_code_sim_first_code_line():
    prediction = "```python\n# compute the area\n    self.area = area(w, h)\nmore code"
    # first line without ` # // : "    self.area = area(w, h)" (26 chars); gold has 8 spaces (30 chars)
    # the 26 chars all match -> ratio = 2 * 26 / 56 = 92.86 -> 93 -> 0.93
    assert m.first_code_line(prediction) == "    self.area = area(w, h)"
    assert m.code_sim_score(prediction, "        self.area = area(w, h)") == 0.93
    assert m.code_sim_score("\n\n// next\nint x = 1;", "int x = 1;") == 1.0
    assert m.code_sim_score("# only\n// comments", "int x = 1;") == 0.0  # no code line -> ""


# --------------------------------------------------------------------------------- per-sample scoring


def test_first_line_cut_only_for_the_four_datasets():
    doc = {"ccq_dataset": "triviaqa", "answers": ["Mercury"], "all_classes": None}
    # after cutting: "Mercury" -> F1 1 -> 100
    assert utils.score_doc(doc, "\n\nMercury\nQuestion: next one") == 100.0
    # qasper is not cut: tokens mercury question next one (4) vs mercury -> P = 1/4 -> F1 = 0.4
    doc = {"ccq_dataset": "qasper", "answers": ["Mercury"], "all_classes": None}
    assert utils.score_doc(doc, "\n\nMercury\nQuestion: next one") == approx(40.0)


def test_process_results_e_buckets():
    doc = {"ccq_dataset": "passage_count", "answers": ["3"], "all_classes": None, "length": 3999}
    assert utils.process_results_e(doc, ["3 or 4"]) == {"score": 50.0, "score_0-4k": 50.0}
    doc["length"] = 4000
    assert utils.process_results_e(doc, ["3"]) == {"score": 100.0, "score_4-8k": 100.0}
    doc["length"] = 8000
    assert utils.process_results_e(doc, ["4"]) == {"score": 0.0, "score_8k+": 0.0}


# --------------------------------------------------------------------------------- cross-checks


def _random_texts(seed, count):
    rng = random.Random(seed)
    vocab = ["the", "a", "cat", "dog", "sat", "on", "mat", ".", ",", "and", "red", "x", "y", "z",
             " ", "  ", "\n", "..", ""]
    for _ in range(count):
        yield (" ".join(rng.choice(vocab) for _ in range(rng.randint(0, 25))),
               " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 25))))


def test_rouge_matches_rouge_package():
    rouge = pytest.importorskip("rouge", reason="cross-check against the `rouge` package LongBench uses")

    def official(prediction, gold):  # LongBench's rouge_score, including its blanket except
        try:
            return rouge.Rouge().get_scores([prediction], [gold], avg=True)["rouge-l"]["f"]
        except Exception:  # noqa: BLE001 - LongBench's bare except, reproduced
            return 0.0

    for prediction, gold in _random_texts(0, 600):
        assert m.rouge_l_f(prediction, gold) == pytest.approx(official(prediction, gold), abs=1e-12), (prediction, gold)


def test_fuzz_ratio_matches_fuzzywuzzy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Using slow pure-python SequenceMatcher"
        fuzz = pytest.importorskip("fuzzywuzzy.fuzz", reason="cross-check against fuzzywuzzy")
    if fuzz.SequenceMatcher.__module__ != "difflib":
        pytest.skip("python-Levenshtein is installed; LongBench's setup uses difflib")
    rng = random.Random(1)
    pairs = list(_random_texts(2, 300))
    # long strings exercise SequenceMatcher's autojunk (sequences of 200+ items)
    pairs += [("".join(rng.choice("ab cd\n") for _ in range(rng.randint(150, 400))),
               "".join(rng.choice("ab cd\n") for _ in range(rng.randint(150, 400)))) for _ in range(50)]
    for first, second in pairs:
        assert m.fuzz_ratio(first, second) == fuzz.ratio(first, second), (first, second)
