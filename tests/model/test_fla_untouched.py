"""ccq-eval leaves fla as it is: after CCQ models were built and run in a process, every attribute of fla's
modules is the object it was, and a plain fla model computes what it computes in a process that never
imported ccq-eval (each side in its own fresh process, tests/model/_fla_untouched_checks.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECKS = Path(__file__).with_name("_fla_untouched_checks.py")


def _start_checks(mode: str, device: str, env: dict, logs: Path, *extra: str, name: str = "") -> subprocess.Popen:
    """The checks in a process of their own, started now; stdout and stderr go to files `name` (default:
    the mode) .out / .err under `logs` (a pipe nobody reads while the other process runs could fill and
    stall it)."""
    name = name or mode
    with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, str(CHECKS), mode, device, *extra], text=True, stdout=out,
                                stderr=err, env={**os.environ, **env})


def _outcome(process: subprocess.Popen, logs: Path, name: str) -> dict:
    process.wait()
    assert process.returncode == 0, (logs / f"{name}.err").read_text()[-4000:]
    return json.loads((logs / f"{name}.out").read_text().strip().splitlines()[-1])


def _autotuner_with_two_candidates():
    import triton
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=8)],
                     key=["n"])
    @triton.jit
    def kernel(x, n, BLOCK: tl.constexpr):
        pass

    return kernel


def test_steered_autotuners_tells_triton_tuning_from_steering():
    """A winner triton adds from the kernel's own candidates (tuned here or read from its disk cache) is no
    change; other candidates, a prune_configs of its own, another winner table, a replaced winner or a
    winner from outside the candidates is one."""
    import importlib.util

    import triton

    spec = importlib.util.spec_from_file_location("fla_untouched_checks", CHECKS)
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)

    def verdict(change) -> list[str]:
        tuner = _autotuner_with_two_candidates()
        tuner.cache[(8, "torch.float32")] = tuner.configs[0]
        before = {"kernel": checks.tuner_state(tuner)}
        change(tuner)
        return checks.steered_autotuners(before, {"kernel": checks.tuner_state(tuner)})

    def tuned(tuner):
        tuner.cache[(64, "torch.float32")] = tuner.configs[1]

    def read_from_disk(tuner):  # triton rebuilds the winner from its JSON file: an equal, new Config
        tuner.cache[(64, "torch.float32")] = triton.Config(**vars(tuner.configs[1]))

    def foreign_winner(tuner):
        tuner.cache[(64, "torch.float32")] = triton.Config({"BLOCK": 128}, num_warps=2)

    def replaced_winner(tuner):
        tuner.cache[(8, "torch.float32")] = tuner.configs[1]

    def own_prune(tuner):
        tuner.prune_configs = lambda kwargs: tuner.configs[:1]

    def other_table(tuner):
        tuner.cache = dict(tuner.cache)

    def fewer_candidates(tuner):
        tuner.configs = tuner.configs[:1]

    def candidate_removed_in_place(tuner):
        tuner.configs.pop()

    assert verdict(lambda tuner: None) == verdict(tuned) == verdict(read_from_disk) == []
    for steering in (foreign_winner, replaced_winner, own_prune, other_table, fewer_candidates,
                     candidate_removed_in_place):
        assert verdict(steering) == ["kernel"], steering.__name__


@pytest.mark.slow  # two fresh processes that build and run fla and CCQ models
def test_fla_unchanged_and_plain_model_as_without_ccq_eval_cpu(tmp_path):
    """On CPU plain fla stops at its first triton kernel: everything it computes before that must have the
    same bits, and it must stop with the same error (ccq-eval's CPU backend must not have reached it)."""
    fresh = _outcome(_start_checks("plain", "cpu", {}, tmp_path), tmp_path, "plain")
    after = _outcome(_start_checks("after-ccq", "cpu", {}, tmp_path), tmp_path, "after-ccq")
    assert not fresh["ccq_eval_imported"] and after["ccq_eval_imported"]
    assert torch.isfinite(torch.tensor(after["ccq_logits_sum"])), "the CCQ models did not run"
    assert after["changed"] == [], "ccq-eval changed fla's modules:\n" + "\n".join(after["changed"])
    assert after["autotuners"] > 10 and after["autotuners_changed"] == [], after["autotuners_changed"]
    assert len(fresh["plain"]["module_outputs"]) >= 2  # at least the embedding and the first norm ran
    assert after["plain"] == fresh["plain"]


@pytest.mark.gpu
@pytest.mark.gpu_long  # minutes: fla's kernels tuned over every candidate in fresh processes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_unchanged_and_plain_model_bit_identical_cuda(tmp_path):
    """The same on CUDA, where the plain model runs through: its logits have the same bits, although the CCQ
    models ran first (over the same fla kernels), and triton's own tuning of fla's kernels (every candidate:
    these processes have no test cap) is the only change to fla's autotuners. The processes share one
    triton cache and the fresh one runs first, so that every kernel the plain model shares with the CCQ
    models finds the fresh process's winner on disk: the same winners on every side. Then one CCQ process
    per architecture, side by side, as triton tunes the candidates of a process one after another."""
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    fresh = _outcome(_start_checks("plain", "cuda", env, tmp_path), tmp_path, "plain")
    assert fresh["plain"]["error"] is None, fresh["plain"]["error"]
    after_processes = {f"after-ccq-{arch}": _start_checks("after-ccq", "cuda", env, tmp_path, arch,
                                                          name=f"after-ccq-{arch}")
                       for arch in ("gla", "gated_deltanet")}
    try:
        outcomes = {name: _outcome(process, tmp_path, name) for name, process in after_processes.items()}
    finally:
        for process in after_processes.values():
            process.kill()  # a no-op once it has exited; otherwise one would tune on after the test failed
    for name, after in outcomes.items():
        assert torch.isfinite(torch.tensor(after["ccq_logits_sum"])), f"{name}: the CCQ models did not run"
        assert after["changed"] == [], f"{name}: ccq-eval changed fla's modules:\n" + "\n".join(after["changed"])
        assert after["autotuners"] > 10 and after["autotuners_changed"] == [], (name, after["autotuners_changed"])
        assert after["plain"] == fresh["plain"], name
