"""Tiny lm-eval-format results written by the tests (no model), shared by tests/cli/test_cli_*.py.

The builders mirror what our tasks log: S-NIAH docs carry length and depth and score
acc / acc_<L> in {0, 100}; perplexity tasks score (nll_sum, n_tokens) pairs under
ppl@<L> (sweep) or ppl@<start>-<end> (position buckets); LongBench scores "score" per
dataset task. The tests in this file check the builders against lm-eval's own format.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ccq_eval.harness import store

SNIAH_TASK = "ccq_s_niah_1"
LENGTHS = (1024, 2048)
DEPTHS = (0, 50, 100)
PER_CELL = 4


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def make_sample(doc_id: int, doc: dict, target: str, prompt: str, response: Any, metrics: dict[str, Any],
                request: str = "generate_until") -> dict[str, Any]:
    """One logged sample as lm_eval.evaluator.evaluate builds it (before the tracker sanitises it)."""
    arguments = (prompt, {"until": [], "max_gen_toks": 8}) if request == "generate_until" else (prompt,)
    return {
        "doc_id": doc_id,
        "doc": doc,
        "target": target,
        "arguments": [arguments],
        "resps": [[response]],
        "filtered_resps": [response],
        "filter": "none",
        "metrics": list(metrics),
        "doc_hash": _hash(json.dumps(doc, indent=2, ensure_ascii=False)),
        "prompt_hash": _hash(prompt),
        "target_hash": _hash(str(target)),
        **metrics,
    }


def results_dict(task: str, values: dict[str, Any], metric_list: list[tuple[str, str, bool]],
                 n: int, higher_is_better: dict[str, bool] | None = None) -> dict[str, Any]:
    """The parts of simple_evaluate's return value that tables / stats read."""
    return {
        "results": {task: {"alias": task, **{f"{k},none": v for k, v in values.items()},
                           **{f"{k}_stderr,none": "N/A" for k in values}}},
        "group_subtasks": {},
        "configs": {task: {"task": task, "metric_list": [
            {"metric": name, "aggregation": agg, "higher_is_better": hib} for name, agg, hib in metric_list]}},
        "versions": {task: 1.0},
        "n-shot": {task: 0},
        "higher_is_better": {task: higher_is_better or {name: hib for name, _, hib in metric_list}},
        "n-samples": {task: {"original": n, "effective": n}},
        "config": {"model": "CUSTOM"},
    }


def revouch(unit: Path) -> None:
    """Record a unit's files again after a test changed them on purpose (as the run that wrote them would)."""
    from ccq_eval.harness.store import formats, vouch

    vouch.write_record(unit, formats.stored_spec(unit / store.UNIT_SPEC_FILE, unit / store.META_FILE) or {})


def as_older_unit(unit: Path) -> None:
    """Make a unit folder look as results format 2 wrote it: no checksums.json, meta.json in format 2."""
    from ccq_eval.harness.store import vouch

    (unit / vouch.CHECKSUMS_FILE).unlink()
    meta = unit / store.META_FILE
    if meta.is_file():
        meta.write_text(json.dumps(json.loads(meta.read_text()) | {"format": 2}))


def write(output: Path, model: str, task: str, results: dict, samples: list[dict]) -> Path:
    unit = store.unit_dir(output, model, task)
    store.write_unit(unit, results, {task: samples}, {"model": model, "task": task})
    return unit.path


def sniah_samples(correct: Callable[[int, int, int], bool]) -> tuple[list[dict], dict[int, list[float]]]:
    """Per-sample records of an S-NIAH-like unit (LENGTHS x DEPTHS x PER_CELL docs, score 100 where
    correct(length, depth, i)) and the scores per length."""
    samples, by_length = [], {length: [] for length in LENGTHS}
    doc_id = 0
    for length in LENGTHS:
        for depth in DEPTHS:
            for index in range(PER_CELL):
                value = str(1000000 + doc_id)
                doc = {"input": f"haystack {length} {depth} {index}", "outputs": [value], "length": length,
                       "depth": depth, "sample": index}
                score = 100.0 if correct(length, depth, index) else 0.0
                by_length[length].append(score)
                # generated text may hold line separators other than \n (U+2028, NEL): JSONL keeps them raw
                samples.append(make_sample(doc_id, doc, value, doc["input"], value if score else "no\u2028\x85",
                                           {"acc": score, f"acc_{length}": score}))
                doc_id += 1
    return samples, by_length


def write_sniah(output: Path, model: str, correct: Callable[[int, int, int], bool],
                task: str = SNIAH_TASK) -> Path:
    """S-NIAH-like unit: LENGTHS x DEPTHS x PER_CELL docs, score 100 where correct(length, depth, i)."""
    samples, by_length = sniah_samples(correct)
    all_scores = [s for scores in by_length.values() for s in scores]
    values = {"acc": sum(all_scores) / len(all_scores)}
    values |= {f"acc_{length}": sum(v) / len(v) for length, v in by_length.items()}
    metric_list = [("acc", "mean", True)] + [(f"acc_{length}", "mean", True) for length in (256, 512, *LENGTHS)]
    return write(output, model, task, results_dict(task, values, metric_list, len(samples)), samples)


def write_ppl_sweep(output: Path, model: str, nll_per_token: dict[int, list[float]]) -> Path:
    """ppl sweep unit: for each length L, documents with the given mean NLL per token (L tokens each)."""
    task = "ccq_ppl_sweep"
    samples, values, doc_id = [], {}, 0
    for length, per_token in nll_per_token.items():
        pairs = []
        for number, mean_nll in enumerate(per_token):
            pair = (mean_nll * (length - 1), length - 1)
            pairs.append(pair)
            doc = {"text": f"document {number} cut at {length}", "length": length, "document": f"d{number}"}
            samples.append(make_sample(doc_id, doc, doc["text"], doc["text"], -pair[0],
                                       {f"ppl@{length}": pair, f"nll@{length}": pair[0],
                                        f"tokens@{length}": pair[1], f"docs@{length}": 1},
                                       request="loglikelihood_rolling"))
            doc_id += 1
        values[f"ppl@{length}"] = math.exp(sum(p[0] for p in pairs) / sum(p[1] for p in pairs))
        values[f"nll@{length}"] = sum(p[0] for p in pairs)
        values[f"tokens@{length}"] = sum(p[1] for p in pairs)
        values[f"docs@{length}"] = len(pairs)
    direction = {}
    for length in nll_per_token:
        direction |= {f"ppl@{length}": False, f"nll@{length}": False, f"tokens@{length}": True,
                      f"docs@{length}": True}
    results = results_dict(task, values, [], len(samples), higher_is_better=direction)
    results["configs"][task]["metric_list"] = []  # the task declares its metrics in Python
    return write(output, model, task, results, samples)


def write_ppl_buckets(output: Path, model: str, bucket_nll: list[list[float]], bucket_size: int = 512) -> Path:
    """ppl buckets unit: one block per entry, per-bucket mean NLL per token (bucket_size tokens each)."""
    task = "ccq_ppl_buckets"
    n_buckets = len(bucket_nll[0])
    ranges = [f"{k * bucket_size}-{(k + 1) * bucket_size}" for k in range(n_buckets)]
    samples = []
    totals = {name: [0.0, 0] for name in ["ppl"] + [f"ppl@{r}" for r in ranges]}
    for block, per_bucket in enumerate(bucket_nll):
        metrics: dict[str, Any] = {}
        for name, mean_nll in zip(ranges, per_bucket):
            metrics[f"ppl@{name}"] = (mean_nll * bucket_size, bucket_size)
        metrics["ppl"] = (sum(m * bucket_size for m in per_bucket), bucket_size * n_buckets)
        for name, pair in metrics.items():
            totals[name][0] += pair[0]
            totals[name][1] += pair[1]
        doc = {"text": f"block {block}", "block_index": block, "length": bucket_size * n_buckets,
               "bucket_size": bucket_size}
        samples.append(make_sample(block, doc, doc["text"], doc["text"], -metrics["ppl"][0], metrics,
                                   request="loglikelihood_rolling"))
    values = {name: math.exp(nll / count) for name, (nll, count) in totals.items()}
    results = results_dict(task, values, [], len(samples), higher_is_better={name: False for name in values})
    results["configs"][task]["metric_list"] = []
    return write(output, model, task, results, samples)


def write_longbench(output: Path, model: str, scores: dict[str, list[float]]) -> list[Path]:
    """One unit per LongBench dataset with the given per-sample scores (0-100)."""
    paths = []
    for dataset, per_sample in scores.items():
        task = f"ccq_longbench_{dataset}"
        samples = [
            make_sample(i, {"input": f"q{i}", "context": "c", "answers": ["a"], "length": 3000 + i,
                            "ccq_dataset": dataset, "_id": f"{dataset}-{i}"}, "['a']", f"prompt {i}", "a",
                        {"score": score})
            for i, score in enumerate(per_sample)
        ]
        results = results_dict(task, {"score": sum(per_sample) / len(per_sample)}, [("score", "mean", True)],
                               len(samples))
        paths.append(write(output, model, task, results, samples))
    return paths


def write_longbench_e(output: Path, model: str, dataset: str, scored: list[tuple[str, float]]) -> Path:
    """LongBench-E unit: (bucket, score) per sample; metrics score and score_<bucket>, as the task logs."""
    task = f"ccq_longbench_e_{dataset}"
    samples = [
        make_sample(i, {"input": f"q{i}", "answers": ["a"], "length": {"0-4k": 1000, "4-8k": 5000, "8k+": 9000}[b],
                        "ccq_dataset": dataset}, "['a']", f"prompt {i}", "a", {"score": v, f"score_{b}": v})
        for i, (b, v) in enumerate(scored)
    ]
    values = {"score": sum(v for _, v in scored) / len(scored)}
    for bucket in ("0-4k", "4-8k", "8k+"):
        in_bucket = [v for b, v in scored if b == bucket]
        if in_bucket:
            values[f"score_{bucket}"] = sum(in_bucket) / len(in_bucket)
    metric_list = [("score", "mean", True)] + [(f"score_{b}", "mean", True) for b in ("0-4k", "4-8k", "8k+")]
    return write(output, model, task, results_dict(task, values, metric_list, len(samples)), samples)


def baseline_correct(length: int, depth: int, index: int) -> bool:
    """Right at 1K everywhere; at 2K only at depth 0: acc 100 at 1K, 33.3 at 2K."""
    return length == 1024 or depth == 0


def variant_correct(length: int, depth: int, index: int) -> bool:
    """Right at 1K everywhere; at 2K at depths 0 and 50: acc 100 at 1K, 66.7 at 2K."""
    return length == 1024 or depth in (0, 50)


LONGBENCH_BASE = {"qasper": [10.0, 30.0, 20.0], "hotpotqa": [50.0, 0.0, 100.0], "lcc": [40.0, 60.0, 50.0]}
LONGBENCH_VAR = {"qasper": [20.0, 30.0, 40.0], "hotpotqa": [50.0, 100.0, 100.0], "lcc": [40.0, 50.0, 60.0]}
SWEEP_BASE = {1024: [2.0, 2.2, 2.4], 2048: [2.5, 2.7, 2.9]}
SWEEP_VAR = {1024: [2.0, 2.1, 2.3], 2048: [2.2, 2.3, 2.4]}
BUCKETS_BASE = [[2.0, 2.5], [2.2, 2.9]]
BUCKETS_VAR = [[2.0, 2.1], [2.2, 2.4]]


def write_all(output: Path, baseline: str = "tiny-gla", variant: str = "tiny-gla-ccq") -> Path:
    """Both models on S-NIAH-1, both perplexity protocols and three LongBench datasets."""
    write_sniah(output, baseline, baseline_correct)
    write_sniah(output, variant, variant_correct)
    write_ppl_sweep(output, baseline, SWEEP_BASE)
    write_ppl_sweep(output, variant, SWEEP_VAR)
    write_ppl_buckets(output, baseline, BUCKETS_BASE)
    write_ppl_buckets(output, variant, BUCKETS_VAR)
    write_longbench(output, baseline, LONGBENCH_BASE)
    write_longbench(output, variant, LONGBENCH_VAR)
    return output


# ------------------------------------------------------------------------------ tests of the builders


def test_written_samples_follow_lm_eval_tracker_format(tmp_path):
    """Our sample files hold what lm-eval's EvaluationTracker.save_results_samples writes."""
    from lm_eval.loggers.evaluation_tracker import EvaluationTracker

    folder = write_sniah(tmp_path / "ours", "m", baseline_correct)
    ours = [json.loads(line) for line in (folder / f"samples_{SNIAH_TASK}.jsonl").read_text().split("\n") if line]

    tracker = EvaluationTracker(output_path=str(tmp_path / "lmeval"))
    tracker.general_config_tracker.model_name_sanitized = "m"
    tracker.date_id = "stamp"
    samples, _ = sniah_samples(baseline_correct)
    tracker.save_results_samples(SNIAH_TASK, samples)
    theirs_path = tmp_path / "lmeval" / "m" / f"samples_{SNIAH_TASK}_stamp.jsonl"
    theirs = [json.loads(line) for line in theirs_path.read_text().split("\n") if line]
    assert ours == theirs


def test_store_reads_lm_eval_cli_layout(tmp_path):
    """results_<stamp>.json next to samples_<task>_<stamp>.jsonl (lm-eval's CLI) is read too."""
    folder = tmp_path / "lm" / "some__model"
    folder.mkdir(parents=True)
    results = results_dict("ccq_s_niah_1", {"acc": 100.0}, [("acc", "mean", True)], 1)  # one logged sample
    results["config"] = {"model": "some/model"}
    (folder / "results_2025-01-01T00-00-00.json").write_text(json.dumps(results))
    sample = make_sample(0, {"length": 1024, "depth": 0}, "1", "p", "1", {"acc": 100.0})
    (folder / "samples_ccq_s_niah_1_2025-01-01T00-00-00.jsonl").write_text(json.dumps(sample) + "\n")
    [unit] = store.load_results(tmp_path / "lm")
    assert unit.model == "some/model"
    assert unit.samples("ccq_s_niah_1")[0]["acc"] == 100.0
