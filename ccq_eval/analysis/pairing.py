"""Which samples of two models are the same document, for paired statistics (ccq_eval.analysis.stats).

Each task's samples fall in groups: "all", plus the length of every task of a family with a length grid
(S-NIAH and the other RULER families: the document's length; chosen by family, ccq_eval.task_families),
the "@L" length or "@start-end" position bucket of a perplexity metric, or LongBench-E's bucket. Within a
group, samples are paired only when they are the same document: by lm-eval's doc_hash (a hash of the
whole document), or by prompt and target hash (the same model input) where that pairs more of them.
Never by position: document k of two runs with other seeds or task settings is another document.
"""

from __future__ import annotations

from typing import Any

from ccq_eval.analysis.tidy import (
    CELL_FAMILIES,
    MetricInfo,
    doc_cell,
    metric_infos,
    primary_metric,
    split_metric,
    stored_value,
    task_family,
)
from ccq_eval.harness.store import ResultsError, StoredUnit
from ccq_eval.task_families import ZEROSHOT, ZEROSHOT_PAPER_COLUMNS


def _ppl_group(suffix_length: int | None, bucket: str | None) -> Any:
    if bucket is not None:
        return bucket
    return "all" if suffix_length is None else suffix_length


def comparison_metric(unit: StoredUnit, task: str, metric: str | None) -> MetricInfo:
    """The metric compared for `task`: --metric, else the task's primary one."""
    infos = metric_infos(unit, task)
    family = task_family(task)
    name = metric or primary_metric(task, infos)
    if name is None:
        raise ResultsError(f"task {task} in {unit.results_path} declares no metric")
    if family == "ppl":
        # Per-document (nll_sum, n_tokens) pairs; perplexity = exp(sum nll / sum n).
        return MetricInfo(name, "nll_pairs", False)
    for info in infos:
        if info.name == name:
            return info
    valid = ", ".join(sorted({split_metric(i.name)[0] for i in infos}))
    raise ResultsError(f"task {task} has no metric {name!r}; its metrics: {valid}")


def comparison_metrics(unit: StoredUnit, task: str, metric: str | None) -> list[MetricInfo]:
    """The metrics compared for `task`: --metric; else, for a task of the zero-shot suite, each metric the
    papers' table shows of it that the task reports (LAMBADA: perplexity and accuracy); else the primary
    one (comparison_metric)."""
    if metric is None and task_family(task) == ZEROSHOT.name:
        reported = {info.name: info for info in metric_infos(unit, task)}
        shown = [reported[name] for paper_task, name, _ in ZEROSHOT_PAPER_COLUMNS
                 if paper_task == task and name in reported]
        if shown:
            return shown
    return [comparison_metric(unit, task, metric)]


def sample_entries(unit: StoredUnit, task: str, info: MetricInfo) -> dict[Any, list[dict[str, Any]]]:
    """group -> [{doc_id, doc_hash, value}] for one model's samples of `task`.

    Groups: "all", plus the length (families with a length grid, S-NIAH and the other RULER families: the
    document's length; perplexity: the "@L" metric), the position bucket ("@start-end") or the LongBench-E
    bucket."""
    family = task_family(task)
    groups: dict[Any, list[dict[str, Any]]] = {}

    def add(group: Any, sample: dict[str, Any], value: Any) -> None:
        prompt = sample.get("prompt_hash")
        groups.setdefault(group, []).append({
            "doc_id": sample.get("doc_id"), "doc_hash": sample.get("doc_hash"),
            "prompt_hash": None if prompt is None else f"{prompt}:{sample.get('target_hash')}", "value": value})

    for sample in unit.samples(task):
        if family == "ppl":
            for key in sample.get("metrics") or [k for k in sample if "@" in k or k == info.name]:
                base, length, bucket = split_metric(key)
                value = stored_value(sample.get(key))
                if base == info.name and isinstance(value, tuple):
                    add(_ppl_group(length, bucket), sample, value)
            continue
        value = stored_value(sample.get(info.name))
        if value is None:
            continue
        add("all", sample, value)
        if family in CELL_FAMILIES:
            length, _ = doc_cell(sample.get("doc"))
            if length is not None:
                add(int(length), sample, value)
        elif family == "longbench-e":  # the bucket is the one score_<bucket> the sample carries
            buckets = [m.removeprefix(f"{info.name}_") for m in sample.get("metrics", [])
                       if m.startswith(f"{info.name}_")]
            if len(buckets) == 1:
                add(buckets[0], sample, value)
    return groups


PAIRING_KEYS = ("doc_hash", "prompt_hash")


def _keyed(samples: list[dict], key: str) -> dict[tuple[str, int], dict]:
    """Samples by (key, occurrence): a document logged twice pairs with the other model's second copy."""
    seen: dict[str, int] = {}
    keyed = {}
    for sample in samples:
        value = sample[key]
        if value is not None:
            keyed[(value, seen.get(value, 0))] = sample
            seen[value] = seen.get(value, 0) + 1
    return keyed


def pair_samples(base: list[dict], var: list[dict]) -> tuple[list[tuple[dict, dict]], str, int]:
    """(pairs, pairing key, unpaired count): samples are paired only when they are the same document, by
    lm-eval's doc_hash (a hash of the whole document) or, where documents differ only in bookkeeping
    fields such as the tokenizer path, by prompt and target hash (the same model input). Never by doc_id:
    position k of two runs with other seeds or task settings is another document."""
    best: tuple[list[tuple[dict, dict]], str] = ([], PAIRING_KEYS[0])
    for key in PAIRING_KEYS:
        base_by, var_by = _keyed(base, key), _keyed(var, key)
        pairs = [(base_by[k], var_by[k]) for k in base_by if k in var_by]
        if len(pairs) > len(best[0]):
            best = (pairs, key)
    pairs, key = best
    return pairs, key, len(base) + len(var) - 2 * len(pairs)


def settings_difference(base: StoredUnit, var: StoredUnit) -> str:
    """What differs between two units' seeds and task settings (from their meta.json), e.g. 'seed 0 vs 1'."""
    def settings(unit: StoredUnit) -> dict[str, Any]:
        spec = unit.meta.get("spec") if isinstance(unit.meta.get("spec"), dict) else {}
        return {"seed": unit.meta.get("seed"), **(spec.get("task_metadata") or {})}

    first, second = settings(base), settings(var)
    names = sorted(name for name in set(first) | set(second) if first.get(name) != second.get(name))
    return ", ".join(f"{name} {first.get(name)} vs {second.get(name)}" for name in names)


def units_of(units: list[StoredUnit], model: str) -> list[StoredUnit]:
    """The units of `model`; an error naming the models there are when it has none."""
    found = [u for u in units if u.model == model]
    if not found:
        models = sorted({u.model for u in units})
        raise ResultsError(f"no results for model {model!r}; models with results: {', '.join(models)}")
    return found


def group_order(group: Any) -> float:
    """Sort key of a group: "all", then lengths in increasing order, then LongBench-E's buckets."""
    if group == "all":
        return -1.0
    if isinstance(group, int):
        return float(group)
    # LongBench-E buckets "0-4k" < "4-8k" < "8k+", after any numeric length
    digits = "".join(ch for ch in str(group).split("-")[0] if ch.isdigit())
    return 1e12 + float(digits or 0)
