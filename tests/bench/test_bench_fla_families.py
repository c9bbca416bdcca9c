"""bench.py's sniah section on fla's own DeltaNet, KDA and Mamba2 (issue 54): the 340M shapes in fla's classes,
and the section's plumbing on the CPU at tiny shapes (the GPU run measures the speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench.py"
FAMILIES = ("delta_net", "kda", "mamba2")


@pytest.fixture
def workload(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from benchlib import workload

    return workload


def test_340m_shapes_build_in_flas_classes_without_ccq(workload):
    """Each family's 340M shape builds (on the meta device) in fla's class with no CCQ layer, at the
    parameter count of flame's config (the 32K vocabulary); CCQ cannot be switched on in it."""
    from ccq_eval.model.families import fla_families

    assert workload.FLA_ARCHS == FAMILIES
    parameters = {}
    for arch in FAMILIES:
        model = workload.build_model(arch, workload.SHAPES_340M[arch], 32000, torch.device("meta"), torch.bfloat16)
        assert isinstance(model, fla_families()[arch].model_class) and workload.ccq_layers(model) == []
        parameters[arch] = workload.parameter_count(model)
        with workload.ccq_mode(model, False) as same:
            assert same is model
        with pytest.raises(ValueError, match="no CCQ layers to switch on"), workload.ccq_mode(model, True):
            pass
    assert parameters == {"delta_net": 374_362_112, "kda": 386_994_368, "mamba2": 382_387_712}


def test_fla_families_run_in_the_sniah_section_only():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ccq_bench_main", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit, match="--archs kda: fla's own families run in the sniah section only"):
        bench.resolve_settings(bench.parse_args(["--smoke", "--archs", "gla,kda"]))
    args = bench.parse_args(["--smoke", "--sections", "sniah", "--archs", ",".join(FAMILIES)])
    settings = bench.resolve_settings(args)
    assert settings["archs"] == list(FAMILIES) and settings["shapes"]["mamba2"]["chunk_size"] == 32


@pytest.mark.slow  # runs benchmarks/bench.py: three tiny models, three generate_until runs each (about 20 s)
def test_sniah_section_runs_fla_families_against_hflm_and_batch_1(tmp_path):
    """Two 512-token S-NIAH-1 samples per family: the adapter at batch 1 and at its default, HFLM on both
    samples, CCQ off alone. In float32 on the CPU the adapter's batch 1 answers as HFLM does (HFLM's
    generate() reaches fla's cache only through the hook build_fla_model adds), and its default batch as
    its batch 1; the speed-ups and the issue-54 targets are read off the rows."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--sections", "sniah", "--archs", ",".join(FAMILIES),
         "--sniah-length", "512", "--sniah-samples", "2", "--sniah-hflm-samples", "2",
         "--out", str(tmp_path), "--name", "families"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "families.json").read_text(encoding="utf-8"))
    assert report["status"] == "complete" and report["errors"] == []
    assert set(report["models"]) == set(FAMILIES)
    rows = report["results"]["sniah"]
    for arch in FAMILIES:
        mine = {(r["method"], r["batch"]): r for r in rows if r["arch"] == arch}
        assert set(mine) == {("ccq_adapter", 1), ("ccq_adapter", None), ("lm_eval HFLM", 1)}
        assert all(r["ccq"] is False and r["samples"] == 2 for r in mine.values())
        batch1, default, hflm = mine["ccq_adapter", 1], mine["ccq_adapter", None], mine["lm_eval HFLM", 1]
        assert len(hflm["texts"]) == 2 and all(hflm["texts"])
        assert batch1["texts"] == hflm["texts"] and batch1["same_text_fraction"] == 1.0
        assert default["texts"] == batch1["texts"] and default["same_text_as_batch1_fraction"] == 1.0
        assert default["speedup_vs_hflm"] == pytest.approx(hflm["seconds_per_sample"] / default["seconds_per_sample"])
        # The tie-aware fields: equal texts, so no split to judge (and no forward run for one).
        for row, against, compared in ((default, "batch1", 2), (batch1, "hflm", 2), (default, "hflm", 2)):
            assert row[f"ties_vs_{against}_fraction"] == 0.0 and row[f"max_gap_ulps_vs_{against}"] is None
            assert row[f"first_divergence_tokens_vs_{against}"] == [None] * compared
            assert row[f"splits_vs_{against}"] == [None] * compared
        assert "ties_vs_batch1_fraction" not in batch1 and "ties_vs_hflm_fraction" not in hflm
    targets = [t for t in report["targets"] if "(issue 54)" in t["name"]]
    assert sorted(t["threshold"] for t in targets) == (
        [">= 50 and batch 1's text or a near tie"] * 3 + ["HFLM's text or a near tie"] * 3)
    assert all(t["passed"] for t in targets if t["threshold"] == "HFLM's text or a near tie")
    assert all("same text 2/2 + near-tie splits 0" in t["detail"] for t in targets)
    markdown = (tmp_path / "families.md").read_text(encoding="utf-8")
    assert "| same text (or near-tie split) | max gap ulps | same text as batch 1 (or near-tie split) |" in markdown
    for arch in FAMILIES:
        assert f"| {arch} | no | lm_eval HFLM | 1 |" in markdown
        assert f"| {arch} | no | ccq_adapter | 1 | no | 512 | 2 |" in markdown
    assert "| 2 + 0 ties / 2 | – | 2 + 0 ties / 2 | – |" in markdown
