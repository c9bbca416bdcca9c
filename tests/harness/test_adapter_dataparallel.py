"""Data-parallel evaluation: two CPU processes (torchrun, gloo through accelerate) give the same
results as one, and the truncation record counts each request once (lm-eval pads the shorter
rank with a repeated request)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from adapter_support import byte_tokenizer, tiny_model
from lm_eval import simple_evaluate
from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.task_registry import make_task_manager

tokenizer = byte_tokenizer()
lm = CCQEvalLM(model=tiny_model(tokenizer), tokenizer=tokenizer, max_length=1024)
metadata = {{"tokenizer": "byt5", "data_files": {files!r}, "lengths": [1024], "depths": [0, 50, 100]}}
out = simple_evaluate(model=lm, tasks=["ccq_ppl_sweep", "ccq_s_niah_1"], bootstrap_iters=0,
                      task_manager=make_task_manager(metadata))
summary = lm.truncation_summary()  # collective: every rank calls it
if lm.rank == 0:
    with open(sys.argv[1], "w") as handle:
        json.dump({{"world_size": lm.world_size, "results": out["results"], "summary": summary,
                   "n_samples": {{task: len(rows) for task, rows in out["samples"].items()}}}}, handle, default=str)
'''


@pytest.mark.slow
def test_two_processes_match_one(tmp_path) -> None:
    files = []
    for index in range(5):
        path = tmp_path / f"doc{index}.txt"
        path.write_text(" ".join(f"word{(index * 7 + k) % 13}" for k in range(180 + 40 * index)), encoding="utf-8")
        files.append(str(path))
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]), files=files), encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")

    outputs = {}
    for label, launcher in (("one", [sys.executable]),
                            ("two", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", "2"])):
        target = tmp_path / f"{label}.json"
        done = subprocess.run([*launcher, str(script), str(target)], check=False, env=env,
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0 and "terminate called without an active exception" in done.stderr:
            # Seen once in 5 runs on a loaded 2-core machine: a gloo worker aborted (SIGABRT) inside
            # torchrun; any other failure, or a second abort, fails the test.
            done = subprocess.run([*launcher, str(script), str(target)], check=False, env=env,
                                  capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[label] = json.loads(target.read_text())

    one, two = outputs["one"], outputs["two"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["n_samples"] == two["n_samples"] == {"ccq_ppl_sweep": 5, "ccq_s_niah_1": 3}
    sweep_one, sweep_two = one["results"]["ccq_ppl_sweep"], two["results"]["ccq_ppl_sweep"]
    assert sweep_two["tokens@1024,none"] == sweep_one["tokens@1024,none"] == 5 * 1023
    assert sweep_two["ppl@1024,none"] == pytest.approx(sweep_one["ppl@1024,none"], rel=1e-9)
    assert two["results"]["ccq_s_niah_1"]["acc,none"] == pytest.approx(one["results"]["ccq_s_niah_1"]["acc,none"])
    assert one["summary"]["policy_counts"] == two["summary"]["policy_counts"] == {"error": 3}
