"""bench.py's model section on the CCQ backbones beyond GLA and Gated DeltaNet (issue 55): fla's own model
against a CCQ model holding the same weights (workload.attach_ccq). On the CPU at tiny shapes: the twin
reads as the baseline at lambda = 0 and acts at the benchmark's gate, the 340M shapes build with the CCQ
gate as the only extra weights, and the section writes a CCQ/baseline row per backbone (the GPU run measures
the speed)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from adapter_support import one_torch_thread  # noqa: F401  (autouse: one torch thread, restored after)

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench.py"
BACKBONES = ("delta_net", "kda", "retnet", "mamba2", "precond_gated_deltanet")


@pytest.fixture
def workload(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from benchlib import workload

    return workload


def bench_module():
    spec = importlib.util.spec_from_file_location("ccq_bench_main", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", BACKBONES)
def test_attached_ccq_reads_as_the_baseline_at_lambda_zero(workload, arch):
    """fp32, 150 tokens (the chunk kernels): lambda = 0 gives fla's model's logits bit for bit, so the twin
    holds every baseline weight; the benchmark's gate (lambda near 2) changes them."""
    from ccq_eval.model.loading import constant_gate_fields

    shape, vocab = workload.SHAPES_SMOKE[arch], 384
    base = workload.build_model(arch, shape, vocab, torch.device("cpu"), torch.float32)
    assert workload.ccq_layers(base) == []
    zero = workload.attach_ccq(base, arch, shape, vocab, **constant_gate_fields(0.0))
    acting = workload.attach_ccq(base, arch, shape, vocab)
    assert len(workload.ccq_layers(acting)) == shape["num_hidden_layers"]
    x = torch.randint(3, vocab, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = base(input_ids=x, use_cache=False).logits
        assert torch.equal(zero(input_ids=x, use_cache=False).logits, expected)
        assert not torch.equal(acting(input_ids=x, use_cache=False).logits, expected)


def test_340m_shapes_attach_with_the_gate_as_the_only_extra_weights(workload):
    """On the meta device: every backbone's 340M shape builds in fla's class and attaches CCQ in every layer,
    in the baseline's dtype; the twin's extra parameters are the gates (a_h of key dim, b_h per head)."""
    assert workload.ATTACH_ARCHS == BACKBONES
    for arch in BACKBONES:
        shape = workload.SHAPES_340M[arch]
        base = workload.build_model(arch, shape, 32000, torch.device("meta"), torch.bfloat16)
        twin = workload.attach_ccq(base, arch, shape, 32000)
        layers = workload.ccq_layers(twin)
        assert len(layers) == shape["num_hidden_layers"] and all(layer.ccq_enabled for layer in layers)
        gates = sum(layer.ccq_gate_weight.numel() + layer.ccq_gate_bias.numel() for layer in layers)
        assert workload.parameter_count(twin) == workload.parameter_count(base) + gates
        assert {p.dtype for p in twin.parameters()} == {torch.bfloat16}


def test_settings_take_the_backbones_in_the_model_section_only():
    bench = bench_module()
    args = ["--smoke", "--sections", "model", "--archs", ",".join(("gla", *BACKBONES))]
    settings = bench.resolve_settings(bench.parse_args(args))
    assert settings["archs"] == ["gla", *BACKBONES] and settings["shapes"]["retnet"]["num_hidden_layers"] == 2
    with pytest.raises(SystemExit, match="--archs retnet: fla's own families run in the sniah section only"):
        bench.resolve_settings(bench.parse_args(["--smoke", "--sections", "sniah", "--archs", "kda,retnet"]))
    with pytest.raises(SystemExit, match="--archs delta_net,precond_gated_deltanet: "):
        bench.resolve_settings(bench.parse_args(["--smoke", "--sections", "model,ops", "--archs",
                                                 "gla,delta_net,precond_gated_deltanet"]))


@pytest.mark.slow  # runs benchmarks/bench.py: five tiny models and their CCQ twins, forward at 128 tokens (~20 s)
def test_model_section_times_each_backbone_against_ccq_attached(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--sections", "model", "--archs", ",".join(BACKBONES),
         "--modes", "forward", "--lengths", "128", "--out", str(tmp_path), "--name", "backbones"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "backbones.json").read_text(encoding="utf-8"))
    assert report["status"] == "complete" and report["errors"] == []
    assert set(report["models"]) == set(BACKBONES)
    rows = {(r["arch"], r["ccq"]): r for r in report["results"]["model"]}
    assert len(rows) == len(report["results"]["model"]) == 2 * len(BACKBONES)
    markdown = (tmp_path / "backbones.md").read_text(encoding="utf-8")
    for arch in BACKBONES:
        base, ccq = rows[arch, False], rows[arch, True]
        for row in (base, ccq):
            assert row["mode"] == "forward" and row["T"] == 128 and row["median_ms"] > 0
            assert row["mfu"] is None and row["flops"] is None  # no FLOP model for these backbones
        assert math.isfinite(ccq["ratio_vs_baseline"]) and ccq["ratio_vs_baseline"] > 0
        assert ccq["ratio_vs_baseline"] == pytest.approx(ccq["median_ms"] / base["median_ms"])
        assert f"| {arch} | fwd | 128 | " in markdown
