"""benchmarks/decode_paths.py on the CPU: the forward paths it compares are the model's, and on the torch
backend in float32 they agree (the GPU run is the measurement)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def decode_paths(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("decode_paths", REPO / "benchmarks" / "decode_paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["delta_net", "kda"])
def test_prefill_and_steps_give_the_whole_forwards_logits_in_float32(decode_paths, arch):
    from benchlib import workload

    shape = dict(workload.SHAPES_340M[arch], hidden_size=128, num_hidden_layers=2, num_heads=2)
    shape.pop("head_dim", None)
    model = workload.build_fla_model(arch, shape, 300, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, 300, (1, 150), generator=torch.Generator().manual_seed(0))
    paths = decode_paths.last_logits_by_path(model, ids, tail=5)
    reference = model(input_ids=ids).logits[0, -1].float()
    assert set(paths) == {"no cache", "cache", "prefill + 5 steps"}
    assert torch.equal(paths["no cache"], reference)
    for logits in paths.values():
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


def test_the_float32_reference_is_the_float32_forward_and_ranks_paths_against_it(decode_paths):
    from benchlib import workload

    shape = dict(workload.SHAPES_340M["delta_net"], hidden_size=64, num_hidden_layers=2, num_heads=2)
    model = workload.build_fla_model("delta_net", shape, 300, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, 300, (1, 80), generator=torch.Generator().manual_seed(1))
    reference = decode_paths.float32_reference(model.to(torch.bfloat16), ids)
    # the bfloat16 weights widened exactly: the float32 copy computes the model those weights define
    assert torch.equal(reference, decode_paths.float32_reference(model.float(), ids))
    lines = decode_paths.report({"same": reference.clone(), "other": -reference}, reference, torch.bfloat16)
    assert lines[1] == "  same: max difference 0.0 ulps (0.0 from same); its argmax is the reference's rank 0"
    assert lines[2].endswith(f"rank {reference.numel() - 1}")


def test_a_tail_outside_the_prompt_is_refused(decode_paths):
    with pytest.raises(SystemExit):
        decode_paths.main(["--length", "8", "--tail", "8", "--device", "cpu"])
