"""benchmarks/bench.py in its CPU smoke mode: the report files, their structure, and the properties
the numbers must have whatever the machine (no timing assertions: CPU timings here mean nothing)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench.py"
ARCHS = ("gla", "gated_deltanet")
SECTIONS = ("model", "ops", "harness", "generation", "sniah")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out), "--name", "smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "smoke.json").read_text(encoding="utf-8"))
    markdown = (out / "smoke.md").read_text(encoding="utf-8")
    return report, markdown, out


def bench_module():
    spec = importlib.util.spec_from_file_location("ccq_bench_main", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_report_header(smoke):
    report, _, _ = smoke
    assert report["schema"] == "ccq-eval-bench/1"
    assert report["status"] == "complete"
    env = report["environment"]
    assert env["device_type"] == "cpu" and env["dtype"] == "float32" and env["torch_threads"] == 1
    for package in ("torch", "transformers", "lm_eval"):
        assert env["packages"][package]
    assert env["packages"]["fla-core"] or env["packages"]["flash-linear-attention"]
    settings = report["settings"]
    assert settings["smoke"] is True and tuple(settings["sections"]) == SECTIONS
    assert set(report["results"]) == set(SECTIONS)
    assert report["matmul"]["flops_per_s"] > 0
    assert set(report["models"]) == set(ARCHS)


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_model_rows_pair_baseline_and_ccq(smoke):
    report, _, _ = smoke
    settings = report["settings"]
    rows = {(r["arch"], r["mode"], r["T"], r["ccq"]): r for r in report["results"]["model"]}
    assert len(rows) == len(report["results"]["model"]) == len(ARCHS) * 2 * len(settings["lengths"]) * 2
    for arch in ARCHS:
        for T in settings["lengths"]:
            for mode in ("forward", "train"):
                base, ccq = rows[(arch, mode, T, False)], rows[(arch, mode, T, True)]
                for row in (base, ccq):
                    assert len(row["times_ms"]) == settings["repeats"]
                    assert row["median_ms"] > 0 and row["tokens"] == settings["batch"] * T
                    assert math.isclose(
                        row["tokens_per_s"], row["tokens"] / (row["median_ms"] / 1000), rel_tol=1e-9
                    )
                    assert row["mfu"] > 0
                assert math.isclose(
                    ccq["ratio_vs_baseline"], ccq["median_ms"] / base["median_ms"], rel_tol=1e-9
                )
                # FLOP model: CCQ adds its covariance pass; the dense part is the same model.
                assert ccq["flops_breakdown_per_token"]["ccq"] > 0
                assert base["flops_breakdown_per_token"]["ccq"] == 0
                assert ccq["flops_breakdown_per_token"]["dense"] == base["flops_breakdown_per_token"]["dense"]
            fwd, train = rows[(arch, "forward", T, True)], rows[(arch, "train", T, True)]
            assert math.isclose(train["flops"], 3 * fwd["flops"], rel_tol=1e-12)


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_ops_rows(smoke):
    report, _, _ = smoke
    ops = [r["op"] for r in report["results"]["ops"]]
    assert len(ops) == 5 and any(op.startswith("ccq_read_chunk") for op in ops)
    assert all(r["median_ms"] > 0 for r in report["results"]["ops"])


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_harness_scores_every_token_and_ccq_changes_the_model(smoke):
    report, _, _ = smoke
    rows = report["results"]["harness"]
    for arch in ARCHS:
        adapter = {}
        for ccq in (False, True):
            methods = {r["method"]: r for r in rows if r["arch"] == arch and r["ccq"] == ccq}
            assert set(methods) == {"bare_forward", "ccq_adapter chunk=2048", "lm_eval HFLM"}
            tokens = methods["bare_forward"]["tokens"]
            assert tokens == report["settings"]["harness_tokens"]
            row = methods["ccq_adapter chunk=2048"]
            assert row["scored_tokens"] == tokens - 1  # every token after BOS
            assert math.isfinite(row["logprob_sum"]) and row["logprob_sum"] < 0
            assert row["throughput_vs_bare"] > 0 and methods["lm_eval HFLM"]["throughput_vs_bare"] > 0
            adapter[ccq] = row["logprob_sum"]
        # Same weights, CCQ switched on in place: the scores must move (lambda > 0).
        assert adapter[True] != adapter[False]


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_generation_rows(smoke):
    report, _, _ = smoke
    settings = report["settings"]
    rows = report["results"]["generation"]
    assert len(rows) == len(ARCHS) * 2 * len(settings["gen_lengths"]) * 2
    for row in rows:
        assert row["method"] in ("ccq_adapter", "hf_generate")
        assert row["prompt_tokens"] <= row["length"] - 128  # S-NIAH keeps the generation budget free
        assert 1 <= row["decode_steps"] <= settings["new_tokens"] - 1
        assert row["prefill_ms"] > 0 and row["decode_ms_per_token"] > 0
        assert row["total_ms"] >= row["prefill_ms"]
        # Both paths decode greedily from the same model and prompt tokens (fp32 on CPU).
        assert row["same_text_as_other_method"] is True
        assert row["replay_ms_per_token"] is None  # no CUDA graphs on CPU
        # The untimed first call (gen_warmup 1 in the smoke settings) is reported beside the timed ones.
        assert row["first_call_ms"] > 0


def test_generation_timing_starts_replay_time_at_the_first_graph_replay(monkeypatch):
    """The graphed decode time is split at the first replay: the graph's warm-up and capture come
    before it (here a 30 ms sleep stands in for them), and the stamping wrapper is removed after. With
    no one-token model call (a graph reused from an earlier call), decoding starts at that replay."""
    import time
    from types import SimpleNamespace

    import torch

    from ccq_eval.model.cuda_graphs.decode import GraphedDecodeStep

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from benchlib import generation_sections

    replayed = []
    step = object.__new__(GraphedDecodeStep)  # no CUDA here: the parts __call__ touches, faked
    step._ids = torch.zeros(1, 1, dtype=torch.long)
    step._graph = SimpleNamespace(replay=lambda: replayed.append(step._ids.item()))
    step._logits = torch.ones(1, 3)
    original = GraphedDecodeStep.__call__

    def generate():
        time.sleep(0.03)
        for token in (5, 6, 7):
            step(torch.tensor([token]))
        return "text"

    timing, out = generation_sections._timed_generation(SimpleNamespace(device=torch.device("cpu")),
                                                        torch.nn.Linear(2, 2), generate, lambda: 3)
    assert out == "text" and replayed == [5, 6, 7]
    assert timing["decode_steps"] == 3
    assert 0 <= timing["replay_ms"] < timing["total_ms"] - 20
    assert timing["decode_ms"] == timing["replay_ms"] and timing["prefill_ms"] >= 20
    assert GraphedDecodeStep.__call__ is original


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_sniah_rows_and_known_failures(smoke):
    report, _, _ = smoke
    rows = report["results"]["sniah"]
    adapter = [r for r in rows if r["method"] == "ccq_adapter"]
    # CCQ off and on, each at batch size 1 and at the adapter's default (1 on the CPU, no graphs).
    assert len(adapter) == len(ARCHS) * 2 * 2
    assert sorted({r["batch"] for r in adapter}, key=str) == [1, None]
    assert all(r["batch_size"] == 1 and r["cuda_graphs"] is False for r in adapter)
    for row in rows:
        expected = report["settings"]["sniah_hflm_samples" if row["method"] == "lm_eval HFLM" else "sniah_samples"]
        assert row["samples"] == expected and row["seconds_per_sample"] > 0
    for arch in ARCHS:
        hflm = [r for r in rows if r["arch"] == arch and not r["ccq"] and r["method"] == "lm_eval HFLM"]
        assert len(hflm) == 1 and hflm[0]["same_text_fraction"] == 1.0
    # No section may fail (stock HFLM's all-ones attention mask is accepted by the CCQ layers).
    assert report["errors"] == []


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_targets_listed(smoke):
    report, _, _ = smoke
    names = [t["name"] for t in report["targets"]]
    for arch in ARCHS:
        assert any(n.startswith(f"{arch} forward CCQ/baseline") for n in names)
        assert any(n.startswith(f"{arch} forward+backward CCQ/baseline") for n in names)
    sniah = [t for t in report["targets"] if "S-NIAH-1" in t["name"]]
    assert {t["threshold"] for t in sniah} == {">= 15 and same text", ">= 100"}
    for target in report["targets"]:
        assert set(target) == {"name", "threshold", "value", "passed", "detail"}


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_markdown_tables(smoke):
    report, markdown, _ = smoke
    assert markdown.startswith("# ccq-eval benchmark (SMOKE")
    assert "dtype float32" in markdown and "transformers" in markdown and "lm_eval" in markdown
    for heading in (
        "## Model forward",
        "## Kernels",
        "## Harness",
        "## Generation",
        "## S-NIAH-1",
        "## Issue 6 targets",
    ):
        assert heading in markdown
    for arch in ARCHS:
        for T in report["settings"]["lengths"]:
            assert f"| {arch} | fwd | {T} |" in markdown and f"| {arch} | fwd+bwd | {T} |" in markdown


@pytest.mark.slow  # the module's `smoke` fixture runs benchmarks/bench.py
def test_merge_reassembles_split_runs(smoke, tmp_path):
    """Sections run in separate device calls merge back into one report with every row."""
    report, _, _ = smoke
    bench = bench_module()
    paths = []
    for part, sections in enumerate((["model", "ops"], ["harness", "generation", "sniah"])):
        piece = dict(
            report,
            results={s: report["results"][s] for s in sections},
            errors=[e for e in report["errors"] if e["section"] in sections],
            settings=dict(report["settings"], sections=sections),
        )
        paths.append(tmp_path / f"part{part}.json")
        paths[-1].write_text(json.dumps(piece), encoding="utf-8")
    assert bench.main(["--merge", *map(str, paths), "--out", str(tmp_path), "--name", "merged"]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text(encoding="utf-8"))
    assert merged["results"] == report["results"]
    assert merged["errors"] == report["errors"]
    assert merged["targets"] == report["targets"]
    assert tuple(merged["settings"]["sections"]) == SECTIONS
    assert "## Issue 6 targets" in (tmp_path / "merged.md").read_text(encoding="utf-8")


def test_bad_flags_name_the_choices(tmp_path):
    bench = bench_module()
    with pytest.raises(SystemExit, match="choose from model, ops, harness, generation, sniah"):
        bench.resolve_settings(bench.parse_args(["--smoke", "--sections", "model,speed"]))
    with pytest.raises(SystemExit, match="expected T,H,K,V"):
        bench.resolve_settings(bench.parse_args(["--smoke", "--ops-shape", "1,2,3"]))
    with pytest.raises(SystemExit, match="--sniah-batches '0,x': expected positive integers or auto"):
        bench.resolve_settings(bench.parse_args(["--smoke", "--sniah-batches", "0,x"]))
    with pytest.raises(SystemExit, match="not a ccq-eval-bench/1 file"):
        (tmp_path / "x.json").write_text("{}", encoding="utf-8")
        bench.main(["--merge", str(tmp_path / "x.json"), "--out", str(tmp_path)])


def test_defaults_follow_the_harness(monkeypatch):
    """With no flags the bench runs the adapter as `ccq-eval run` does: graphs, the default batch size
    and the default chunk size where CUDA is (the graphed forward joins the model section), eager
    without CUDA or with --no-cuda-graphs."""
    bench = bench_module()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = bench.resolve_settings(bench.parse_args([]))
    assert on_gpu["cuda_graphs"] is True and "sniah" in on_gpu["sections"]
    assert on_gpu["sniah_batches"] == [1, None] and "forward_graphed" in on_gpu["modes"]
    from ccq_eval.harness.scoring import DEFAULT_CHUNK_SIZE

    assert on_gpu["adapter_chunk_sizes"] == [DEFAULT_CHUNK_SIZE] == [on_gpu["sniah_chunk_size"]]
    eager = bench.resolve_settings(bench.parse_args(["--no-cuda-graphs"]))
    assert eager["cuda_graphs"] is False and eager["modes"] == ["forward", "train"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_cpu = bench.resolve_settings(bench.parse_args([]))
    assert on_cpu["device"] == "cpu" and on_cpu["cuda_graphs"] is False and on_cpu["modes"] == ["forward", "train"]


def test_dataparallel_compare(tmp_path):
    """benchmarks/dataparallel.py --compare: per-sample texts matched by doc_id, throughput ratio from
    the slowest rank's generate time (the evaluation itself needs torchrun and is run by hand)."""
    spec = importlib.util.spec_from_file_location("ccq_bench_dp", REPO / "benchmarks" / "dataparallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(world, seconds, texts):
        return {
            "schema": module.SCHEMA,
            "world_size": world,
            "device": "cpu",
            "dtype": "float32",
            "arch": "gla",
            "ccq": False,
            "length": 1024,
            "samples": len(texts),
            "seconds": seconds + 1,
            "generate_wall_s": seconds,
            "samples_per_s": len(texts) / seconds,
            "per_sample": [{"doc_id": i, "depth": 0, "text": t} for i, t in enumerate(texts)],
        }

    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(run(1, 8.0, ["a", "b", "c", "d"])), encoding="utf-8")
    two.write_text(json.dumps(run(2, 4.0, ["a", "b", "x", "d"])), encoding="utf-8")
    assert module.main(["--compare", str(one), str(two), "--out", str(tmp_path), "--name", "cmp"]) == 0
    summary = json.loads((tmp_path / "cmp.json").read_text(encoding="utf-8"))
    assert summary["same_per_sample_text"] is False and summary["n_differing"] == 1
    assert summary["throughput_ratio"] == pytest.approx(2.0)
    assert summary["targets"] == {"same results": False, "throughput >= 1.8x": True}
    assert "DIFFERENT" in (tmp_path / "cmp.md").read_text(encoding="utf-8")
