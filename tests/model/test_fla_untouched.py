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


def _start_checks(mode: str, device: str, env: dict, logs: Path, *extra: str) -> subprocess.Popen:
    """The checks in a process of their own, started now; stdout and stderr go to files under `logs` (a
    pipe nobody reads while the other process runs could fill and stall it)."""
    with open(logs / f"{mode}.out", "w") as out, open(logs / f"{mode}.err", "w") as err:
        return subprocess.Popen([sys.executable, str(CHECKS), mode, device, *extra], text=True, stdout=out,
                                stderr=err, env={**os.environ, **env})


def _outcome(process: subprocess.Popen, logs: Path, mode: str) -> dict:
    process.wait()
    assert process.returncode == 0, (logs / f"{mode}.err").read_text()[-4000:]
    return json.loads((logs / f"{mode}.out").read_text().strip().splitlines()[-1])


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
@pytest.mark.gpu_long  # minutes: fla's GLA kernels tuned over every candidate in a fresh process
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_unchanged_and_plain_model_bit_identical_cuda(tmp_path):
    """The same on CUDA, where the plain model runs through: its logits have the same bits, although the CCQ
    models ran first (over the same fla kernels). Both processes share one triton cache, so the plain
    model's kernels, tuned over all of triton's candidates, have the same winners
    on both sides (the fresh process tunes first, the other finds its winners on disk). The two processes
    start together: the second builds and runs its CCQ models while the first tunes, and runs its plain
    model only once the first has finished."""
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    ready = tmp_path / "plain-finished"
    after_process = _start_checks("after-ccq", "cuda", env, tmp_path, str(ready))
    try:
        fresh = _outcome(_start_checks("plain", "cuda", env, tmp_path), tmp_path, "plain")
        ready.touch()
        after = _outcome(after_process, tmp_path, "after-ccq")
    finally:
        after_process.kill()  # a no-op once it has exited; otherwise it would wait for `ready` forever
    assert fresh["plain"]["error"] is None, fresh["plain"]["error"]
    assert torch.isfinite(torch.tensor(after["ccq_logits_sum"])), "the CCQ models did not run"
    assert after["changed"] == [], "ccq-eval changed fla's modules:\n" + "\n".join(after["changed"])
    assert after["autotuners"] > 10 and after["autotuners_changed"] == [], after["autotuners_changed"]
    assert after["plain"] == fresh["plain"]
