"""benchmarks/first_run.py on CPU: a checkpoint folder a user would have, then the same `ccq-eval run`
twice in new processes (cold, then warm triton cache), timed, with the samples counted."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def first_run_module():
    spec = importlib.util.spec_from_file_location("ccq_first_run", REPO / "benchmarks" / "first_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_times_a_cold_and_a_warm_run(tmp_path):
    module = first_run_module()
    out = tmp_path / "first"
    assert module.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads((out / "first_run.json").read_text(encoding="utf-8"))
    assert report["schema"] == module.SCHEMA and report["smoke"] and report["ccq"] and report["parameters"] > 0
    for label in ("cold", "warm"):
        run = report["runs"][label]
        assert run["returncode"] == 0 and run["samples"] == 2 and run["seconds"] > 0
        # the defaults
        assert run["command"][1:5] == ["-m", "ccq_eval", "run", "-m"] and "--device" not in run["command"]
        assert (out / f"run-{label}" / "table.md").is_file()
    assert (out / "checkpoint" / "model.safetensors").is_file() and (out / "checkpoint" / "tokenizer.json").is_file()
    with pytest.raises(SystemExit, match="is not empty"):  # a cold run needs a new folder
        module.main(["--smoke", "--out", str(out)])
