"""`ccq-eval lm-eval ...` is lm-eval's own CLI with the `ccq` model registered."""

import json
import math
from pathlib import Path

from typer.testing import CliRunner

from ccq_eval.cli import app

REPO = Path(__file__).resolve().parents[2]


def test_lm_eval_cli_runs_our_model_on_our_task(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    document = tmp_path / "doc.txt"
    document.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    metadata = {"tokenizer": str(REPO / "models" / "tiny-gla"), "lengths": [256], "data_files": [str(document)]}
    result = CliRunner().invoke(app, [
        "lm-eval", "run", "--model", "ccq", "--model_args", "pretrained=tiny-gla,max_length=256",
        "--tasks", "ccq_ppl_sweep", "--include_path", "tasks/ppl", "--metadata", json.dumps(metadata),
        "--output_path", str(tmp_path / "out"),
    ])
    assert result.exit_code == 0, result.output
    # no CUDA warning on a CPU machine (lm-eval's default device), no --metadata hint (it was given)
    assert "CUDA is not available" not in result.output and "Custom kwargs" not in result.output
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    values = json.loads(results_file.read_text())["results"]["ccq_ppl_sweep"]
    assert values["tokens@256,none"] == 255  # 256 tokens in, 255 predictions
    assert 1.0 < values["ppl@256,none"] < 256 and math.isfinite(values["ppl@256,none"])
