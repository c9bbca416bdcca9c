"""`ccq-eval run` under torchrun, as the README launches it: two CPU processes (gloo) store the same
per-sample results as one process, on the smallest grid that has both task families (S-NIAH
generation, perplexity scoring) with the embedded tiny GLA model. Rank 0 alone writes the folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CCQ_EVAL = Path(sys.executable).parent / "ccq-eval"  # the console script `pip install -e .` made
TASKS = ("ccq_s_niah_1", "ccq_ppl_sweep")
# 4 S-NIAH prompts (2 depths x 2 samples) and 2 perplexity documents at 1K: each rank gets both kinds.
RUN = ["run", "-m", "tiny-gla", "-t", "s-niah-1", "-t", "ppl-sweep", "--lengths", "1k", "--depths", "0,100",
       "--samples-per-cell", "2", "--lm-eval-arg", "bootstrap_iters=0", "--quiet", "--no-report"]


def _run(launcher: list[str], output: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([*launcher, str(CCQ_EVAL), *RUN, "--output", str(output)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def _per_sample(output: Path, task: str) -> dict[int, dict]:
    path = output / "tiny-gla" / task / f"samples_{task}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return {row["doc_id"]: {key: row[key] for key in ("doc_hash", "resps", "filtered_resps", "metrics")}
            | {metric: row[metric] for metric in row["metrics"]} for row in rows}


@pytest.mark.slow
def test_two_processes_store_what_one_process_stores(tmp_path):
    assert CCQ_EVAL.is_file(), f"{CCQ_EVAL} missing: install the project (pip install -e .)"
    _run([], tmp_path / "one")
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python"],
         tmp_path / "two")

    for task in TASKS:
        one, two = _per_sample(tmp_path / "one", task), _per_sample(tmp_path / "two", task)
        assert sorted(one) == list(range({"ccq_s_niah_1": 4, "ccq_ppl_sweep": 2}[task]))
        assert two == one, task  # every generated text, log-likelihood and per-sample metric
        unit = tmp_path / "two" / "tiny-gla" / task
        meta = json.loads((unit / "meta.json").read_text())
        assert meta["world_size"] == 2 and meta["device"] == "cpu" and meta["cuda_graphs"] is False
        results_one = json.loads((tmp_path / "one" / "tiny-gla" / task / "results.json").read_text())["results"]
        results_two = json.loads((unit / "results.json").read_text())["results"]
        assert results_two[task].keys() == results_one[task].keys()
        for key, value in results_one[task].items():
            if isinstance(value, float):  # aggregates: sums in another order at most
                assert results_two[task][key] == pytest.approx(value, rel=1e-12), key
    # One copy of each unit in lm-eval's tracker layout: only rank 0 wrote.
    assert len(list((tmp_path / "two" / "lm_eval" / "tiny-gla").glob("results_*.json"))) == len(TASKS)
