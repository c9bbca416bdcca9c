"""LongBench-shaped synthetic data for timing runs: one jsonl file per dataset with the official record
fields (input, context, answers, length, dataset, language, all_classes, _id) at LongBench's real
sample counts and average lengths, the text generated offline.

English text is drawn from the embedded corpora (ccq_eval.data.corpora), Chinese text from a fixed
set of common characters, code from the Python standard library's own source files. The texts mean
nothing: the files exist so that `ccq-eval run --suite paper` builds its prompts with the project's
LongBench templates from inputs of the real sizes, and generates the real number of tokens per dataset.
"""

from __future__ import annotations

import json
import random
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

from ccq_eval.tasks.longbench import categories, spec

# LongBench v1 test sets (THUDM/LongBench, LongBench/task.md "LongBench statistics", the paper's
# Table 1): average length and number of samples per dataset, 4,750 samples in all. Lengths are words
# (str.split) for English and code, characters for Chinese, as LongBench counts them.
V1_STATS: dict[str, tuple[int, int]] = {
    "narrativeqa": (18409, 200),
    "qasper": (3619, 200),
    "multifieldqa_en": (4559, 150),
    "multifieldqa_zh": (6701, 200),
    "hotpotqa": (9151, 200),
    "2wikimqa": (4887, 200),
    "musique": (11214, 200),
    "dureader": (15768, 200),
    "gov_report": (8734, 200),
    "qmsum": (10614, 200),
    "multi_news": (2113, 200),
    "vcsum": (15380, 200),
    "trec": (5177, 200),
    "triviaqa": (8209, 200),
    "samsum": (6258, 200),
    "lsht": (22337, 200),
    "passage_count": (11141, 200),
    "passage_retrieval_en": (9289, 200),
    "passage_retrieval_zh": (6745, 200),
    "lcc": (1235, 500),
    "repobench-p": (4206, 500),
}
# LongBench-E (same file, "LongBench-E statistics"): samples in the 0-4k, 4-8k and 8k+ word buckets.
E_BUCKET_COUNTS: dict[str, tuple[int, int, int]] = {
    "hotpotqa": (100, 100, 100),
    "2wikimqa": (100, 100, 100),
    "multifieldqa_en": (67, 70, 13),
    "qasper": (100, 100, 24),
    "gov_report": (100, 100, 100),
    "multi_news": (100, 100, 94),
    "triviaqa": (100, 100, 100),
    "samsum": (100, 100, 100),
    "trec": (100, 100, 100),
    "passage_retrieval_en": (100, 100, 100),
    "passage_count": (100, 100, 100),
    "lcc": (100, 100, 100),
    "repobench-p": (100, 100, 100),
}
# Word ranges drawn for the LongBench-E buckets (the 8k+ bucket has no upper bound; 16K is our choice).
E_BUCKET_RANGES = ((500, 4000), (4000, 8000), (8000, 16000))
# A sample's length is drawn uniformly within this factor range of the dataset's average (so the
# mean stays the published one); the published spread is wider, the total work is the same.
SPREAD = (0.5, 1.5)
RETRIEVAL_PARAGRAPHS = 30  # passage_retrieval_en's prompt says 30 paragraphs
CHINESE_CHARACTERS = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种"
    "面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本"
    "去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比"
    "或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总"
)


# ------------------------------------------------------------------------------------------ text
@lru_cache(maxsize=1)
def english_words() -> tuple[str, ...]:
    """Every word of the embedded corpora (both splits), in order."""
    from ccq_eval.data.corpora import list_corpora, load_corpus

    return tuple(word for name in list_corpora() for doc in load_corpus(name) for word in doc.text.split())


@lru_cache(maxsize=1)
def code_lines() -> tuple[str, ...]:
    """Non-empty lines of the standard library's top-level Python modules, in file-name order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for path in sorted(stdlib.glob("*.py")):
        lines += [
            line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()
        ]
    return tuple(lines)


def english(rng: random.Random, words: int) -> str:
    """`words` consecutive corpus words from a random place."""
    source = english_words()
    start = rng.randrange(max(1, len(source) - words))
    text = source[start : start + words]
    while len(text) < words:  # longer than the corpora: wrap around
        text += source[: words - len(text)]
    return " ".join(text)


def chinese(rng: random.Random, characters: int) -> str:
    """`characters` characters: common characters in sentences of 10-30, each ended by "。"."""
    out: list[str] = []
    while len(out) < characters:
        out += [*rng.choices(CHINESE_CHARACTERS, k=rng.randint(9, 29)), "。"]
    return "".join(out[:characters])


def code(rng: random.Random, words: int) -> tuple[str, str]:
    """About `words` words of consecutive source lines from a random place, and the line after them."""
    source = code_lines()
    start, taken, count = rng.randrange(len(source) // 2), [], 0
    for line in source[start:]:
        if count >= words:
            break
        taken.append(line)
        count += len(line.split())
    return "\n".join(taken) + "\n", source[(start + len(taken)) % len(source)].strip()


def text(rng: random.Random, language: str, size: int) -> str:
    """Running text of `size` words (English, code) or characters (Chinese)."""
    if language == "zh":
        return chinese(rng, size)
    return code(rng, size)[0] if language == "code" else english(rng, size)


# ------------------------------------------------------------------------------------------ records
def labels(rng: random.Random, language: str, count: int) -> list[str]:
    """`count` distinct class names (trec: English words, lsht: two Chinese characters)."""
    found: dict[str, None] = {}
    while len(found) < count:
        label = (
            chinese(rng, 2).replace("。", "") if language == "zh" else english(rng, 1).strip(".,;:!?\"'()")
        )
        if len(label) >= 2:
            found[label.capitalize()] = None
    return list(found)


def record(
    dataset: str, size: int, rng: random.Random, index: int, longbench_e: bool = False
) -> dict[str, Any]:
    """One record of `dataset` whose context has about `size` words (characters for Chinese)."""
    language = categories.DATASET_LANGUAGE[dataset]
    question = chinese(rng, 20) if language == "zh" else english(rng, 12) + "?"
    answers = [chinese(rng, 6) if language == "zh" else english(rng, 4)]
    all_classes = None
    if dataset.startswith("passage_retrieval") or dataset == "passage_count":
        label = "段落{}：" if language == "zh" else "Paragraph {}: "
        pool = [
            text(rng, language, max(1, size // RETRIEVAL_PARAGRAPHS)) for _ in range(RETRIEVAL_PARAGRAPHS)
        ]
        if dataset == "passage_count":  # paragraphs repeated and shuffled; the answer is the distinct count
            unique = rng.randint(max(1, RETRIEVAL_PARAGRAPHS // 3), RETRIEVAL_PARAGRAPHS)
            pool = [rng.choice(pool[:unique]) for _ in range(RETRIEVAL_PARAGRAPHS)]
            answers = [str(len(set(pool)))]
        else:
            answers = [("段落{}" if language == "zh" else "Paragraph {}").format(rng.randint(1, len(pool)))]
            question = text(rng, language, max(8, size // (4 * RETRIEVAL_PARAGRAPHS)))
        context = "\n\n".join(label.format(i) + paragraph for i, paragraph in enumerate(pool, 1))
    elif dataset in ("trec", "lsht"):  # few-shot classification: examples with their class
        all_classes = labels(random.Random(dataset), language, 50 if dataset == "trec" else 24)
        shots, words = [], 0
        while words < size:
            example = text(rng, language, 12 if language == "en" else 60)
            shots.append(
                f"{example}\nType: {rng.choice(all_classes)}"
                if language == "en"
                else f"新闻：{example}\n类别：{rng.choice(all_classes)}"
            )
            words += len(shots[-1]) if language == "zh" else len(shots[-1].split())
        context = "\n".join(shots)
        question = (
            f"Question: {question}\nType:" if language == "en" else f"新闻：{text(rng, language, 60)}\n类别："
        )
        answers = [rng.choice(all_classes)]
    elif language == "code":
        context, answer = code(rng, size)
        question = ""
        if dataset == "repobench-p":  # cross-file snippets, then the file being completed
            question = code(rng, 40)[0]
        answers = [answer or "pass"]
    else:
        context = text(rng, language, size)
    length = len(context) if language == "zh" else len(context.split())
    return {
        "input": question,
        "context": context,
        "answers": answers,
        "length": length,
        "dataset": f"{dataset}_e" if longbench_e else dataset,
        "language": language,
        "all_classes": all_classes,
        "_id": f"synthetic-{dataset}{'-e' if longbench_e else ''}-{index}",
    }


def sizes(
    dataset: str, rng: random.Random, *, samples: int | None, length_scale: float, longbench_e: bool
) -> list[int]:
    """Context sizes of a dataset's records: the published counts (capped at `samples` when given) and
    lengths around the published average (LongBench-E: within each bucket), times length_scale."""
    if longbench_e:
        drawn = [
            rng.randint(*E_BUCKET_RANGES[bucket])
            for bucket, count in enumerate(E_BUCKET_COUNTS[dataset])
            for _ in range(count)
        ]
    else:
        average, count = V1_STATS[dataset]
        drawn = [round(average * rng.uniform(*SPREAD)) for _ in range(count)]
    if samples is not None:
        drawn = drawn[:: max(1, len(drawn) // samples)][:samples]
    return [max(8, round(size * length_scale)) for size in drawn]


def write_longbench(
    folder: Path,
    *,
    datasets: tuple[str, ...] = spec.LONGBENCH_DATASETS,
    samples: int | None = None,
    length_scale: float = 1.0,
    longbench_e: bool = False,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Write <dataset>.jsonl (LongBench-E: <dataset>_e.jsonl) for each dataset into `folder`; returns
    {file stem: {samples, mean_length, language}}."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for dataset in datasets:
        rng = random.Random(f"{seed}-{dataset}-{longbench_e}")
        records = [
            record(dataset, size, rng, index, longbench_e)
            for index, size in enumerate(
                sizes(dataset, rng, samples=samples, length_scale=length_scale, longbench_e=longbench_e)
            )
        ]
        stem = f"{dataset}_e" if longbench_e else dataset
        with (folder / f"{stem}.jsonl").open("w", encoding="utf-8") as handle:
            for item in records:
                handle.write(json.dumps(item, ensure_ascii=False) + "\n")
        written[stem] = {
            "samples": len(records),
            "mean_length": sum(r["length"] for r in records) / len(records),
            "language": records[0]["language"],
        }
    return written
