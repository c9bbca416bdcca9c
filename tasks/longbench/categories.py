"""LongBench task categories, languages and averages, for tables and figures.

Standard library only, so results code imports it without lm-eval:

    from ccq_eval.tasks.longbench import categories
    per_dataset = categories.scores_from_results(results_json["results"])        # {dataset: score}
    categories.category_averages(per_dataset, language="en")                      # {category: mean}
    categories.leaderboard_average(per_dataset, language="en")                    # LongBench "Avg"

Facts from THUDM/LongBench (commit 2e00731f8d0bff23dc4325161044d0ed8af94c1e, LongBench/README.md and
task.md): six task types; 14 English, 5 Chinese and 2 code datasets. The README's English (Chinese)
leaderboard averages, per category, the English (Chinese) datasets plus the two code datasets, and its
"Avg" is the mean of the six category averages (e.g. ChatGLM3-6B-32k English: 48.5).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from statistics import fmean

# Category slug -> column label, in the order of LongBench's per-dataset tables.
CATEGORY_LABELS: dict[str, str] = {
    "single_doc_qa": "Single-Doc QA",
    "multi_doc_qa": "Multi-Doc QA",
    "summarization": "Summarization",
    "few_shot": "Few-shot",
    "synthetic": "Synthetic",
    "code": "Code",
}

# Dataset -> category slug, all 21 LongBench v1 datasets in the official order.
DATASET_CATEGORY: dict[str, str] = {
    "narrativeqa": "single_doc_qa",
    "qasper": "single_doc_qa",
    "multifieldqa_en": "single_doc_qa",
    "multifieldqa_zh": "single_doc_qa",
    "hotpotqa": "multi_doc_qa",
    "2wikimqa": "multi_doc_qa",
    "musique": "multi_doc_qa",
    "dureader": "multi_doc_qa",
    "gov_report": "summarization",
    "qmsum": "summarization",
    "multi_news": "summarization",
    "vcsum": "summarization",
    "trec": "few_shot",
    "triviaqa": "few_shot",
    "samsum": "few_shot",
    "lsht": "few_shot",
    "passage_count": "synthetic",
    "passage_retrieval_en": "synthetic",
    "passage_retrieval_zh": "synthetic",
    "lcc": "code",
    "repobench-p": "code",
}

# Dataset -> "en" | "zh" | "code" (task.md counts the two code sets apart from both languages).
DATASET_LANGUAGE: dict[str, str] = {
    dataset: ("code" if category == "code" else "zh" if dataset in {
        "multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"} else "en")
    for dataset, category in DATASET_CATEGORY.items()
}

ENGLISH_DATASETS: tuple[str, ...] = tuple(d for d, lang in DATASET_LANGUAGE.items() if lang == "en")
CHINESE_DATASETS: tuple[str, ...] = tuple(d for d, lang in DATASET_LANGUAGE.items() if lang == "zh")
CODE_DATASETS: tuple[str, ...] = tuple(d for d, lang in DATASET_LANGUAGE.items() if lang == "code")

# LongBench-E (13 datasets) uses the same categories.
LONGBENCH_E_DATASETS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)

# The 14 English datasets of the Gated DeltaNet paper's LongBench table (no passage tasks).
GATED_DELTANET_DATASETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report",
    "qmsum", "multi_news", "trec", "triviaqa", "samsum", "lcc", "repobench-p",
)

_LANGUAGE_DATASETS: dict[str, tuple[str, ...]] = {
    "en": ENGLISH_DATASETS + CODE_DATASETS,
    "zh": CHINESE_DATASETS + CODE_DATASETS,
    "all": tuple(DATASET_CATEGORY),
}


def datasets_of(language: str = "all") -> tuple[str, ...]:
    """Datasets counted in a leaderboard: "en" / "zh" (that language plus code) or "all"."""
    if language not in _LANGUAGE_DATASETS:
        raise ValueError(f"unknown language {language!r}; valid: {', '.join(_LANGUAGE_DATASETS)}")
    return _LANGUAGE_DATASETS[language]


def category_averages(scores: Mapping[str, float], language: str = "all",
                      datasets: Iterable[str] | None = None) -> dict[str, float]:
    """Mean score of each category over the datasets present in ``scores``.

    ``datasets`` restricts the datasets counted (default: those of ``language``). A category with no
    scored dataset is left out rather than reported as 0.
    """
    allowed = set(datasets) if datasets is not None else set(datasets_of(language))
    unknown = sorted(set(scores) - set(DATASET_CATEGORY))
    if unknown:
        raise ValueError(f"not LongBench datasets: {', '.join(unknown)}; valid: {', '.join(DATASET_CATEGORY)}")
    averages: dict[str, float] = {}
    for category in CATEGORY_LABELS:
        values = [scores[d] for d, c in DATASET_CATEGORY.items() if c == category and d in allowed and d in scores]
        if values:
            averages[category] = fmean(values)
    return averages


def leaderboard_average(scores: Mapping[str, float], language: str = "en") -> float:
    """LongBench leaderboard "Avg": mean of the category averages (requires every category)."""
    averages = category_averages(scores, language=language)
    missing = [label for slug, label in CATEGORY_LABELS.items() if slug not in averages]
    if missing:
        raise ValueError(f"no scored dataset for categories {', '.join(missing)}; the leaderboard average "
                         "needs all six")
    return fmean(averages.values())


def dataset_of_task(task_name: str) -> tuple[str, bool] | None:
    """(dataset, is_longbench_e) for a ccq_longbench task name, None for any other name (groups too)."""
    for prefix, is_e in (("ccq_longbench_e_", True), ("ccq_longbench_", False)):
        if task_name.startswith(prefix):
            dataset = task_name[len(prefix):]
            known = LONGBENCH_E_DATASETS if is_e else tuple(DATASET_CATEGORY)
            if dataset in known:
                return dataset, is_e
    return None


def scores_from_results(results: Mapping[str, Mapping[str, object]], longbench_e: bool = False,
                        metric: str = "score", filter_name: str = "none") -> dict[str, float]:
    """{dataset: value} from lm-eval's results["results"] (keys "<metric>,<filter>").

    ``metric`` may be "score" or, for LongBench-E, "score_0-4k" / "score_4-8k" / "score_8k+".
    """
    key = f"{metric},{filter_name}"
    found: dict[str, float] = {}
    for name, values in results.items():
        parsed = dataset_of_task(name)
        if parsed is None or parsed[1] != longbench_e or key not in values:
            continue
        value = values[key]
        if isinstance(value, (int, float)):
            found[parsed[0]] = float(value)
    return found
