"""`ccq-eval inspect` on a plain checkpoint with --baseline-lambda: CCQ's read at a constant lambda against
the plain read on the same weights, checked against the checkpoint with CCQ attached at that lambda (which
`run --ccq-attach` evaluates), and the README's mechanism figure."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from ccq_eval.inspection.measure import CCQSettings, measure_layer, sample_positions
from ccq_eval.inspection.prompts import needle_prompts
from ccq_eval.inspection.reads import ReadRecorder
from ccq_eval.inspection.run import InspectOptions, check_models, inspect_model, run_inspect
from ccq_eval.model.loading import load_model

LENGTH, DEPTH = 1024, 50.0


@pytest.fixture(scope="module", params=["tiny-gdn", "tiny-gla"])
def plain(request):
    name = request.param
    return name, check_models([name])[name]


def _first_layer_rows(model, prompt) -> list[dict]:
    """measure_layer's rows of layer 0 for `model` on one prompt (a CCQ model's read as it runs)."""
    recorder = ReadRecorder(model)
    with torch.no_grad(), recorder.capture():
        model(input_ids=torch.tensor([prompt.input_ids]), use_cache=False, logits_to_keep=1)
    positions = sample_positions(len(prompt.input_ids), 4, prompt)
    return measure_layer(recorder.ordered()[0], prompt, CCQSettings(model.config), positions)[0]


def test_baseline_lambda_reads_as_the_checkpoint_with_ccq_attached(plain):
    """Layer 0 sees the same input in the plain model and in the attached one, so there inspect's CCQ read
    of the plain checkpoint at lambda 1 is the attached model's own read (needle share, query move), and its
    plain read is the attached model's read with r; the lambda the rows record is the one asked."""
    name, folder = plain
    options = InspectOptions(models=[name], lengths=[LENGTH], depths=[DEPTH], positions=4, baseline_lambda=1.0)
    rows = pd.DataFrame(inspect_model(name, folder, options, "cpu")[0])
    assert (rows["lambda_source"] == "constant").all() and (rows["lambda_answer"] == 1.0).all()
    first = rows[rows["layer"] == 0].sort_values("head")
    [prompt] = needle_prompts("s-niah-1", str(folder), [LENGTH], [DEPTH])
    attached, _ = load_model(str(folder), ccq_lambda=1.0)
    reference = pd.DataFrame(_first_layer_rows(attached, prompt)).sort_values("head")
    assert (reference["lambda_source"] == "gate").all()
    for column in ("needle_share_on", "needle_share_off", "value_share_on", "q_move_answer", "q_cos_answer"):
        assert first[column].to_numpy() == pytest.approx(reference[column].to_numpy(), rel=1e-5, abs=1e-7), column
    assert (rows["needle_share_on"] != rows["needle_share_off"]).any()  # lambda 1 moves the read


def test_baseline_lambda_zero_is_the_plain_read(plain):
    name, folder = plain
    options = InspectOptions(models=[name], lengths=[LENGTH], depths=[DEPTH], positions=4, baseline_lambda=0.0)
    rows = pd.DataFrame(inspect_model(name, folder, options, "cpu")[0])
    assert (rows["needle_share_on"] == rows["needle_share_off"]).all()
    assert (rows["q_move_answer"] == 0).all()


def test_mechanism_figure_is_one_small_png(tmp_path):
    out, figure = tmp_path / "inspect", tmp_path / "docs" / "ccq-mechanism.png"
    written = run_inspect(InspectOptions(models=["tiny-gdn"], lengths=[LENGTH], depths=[0.0, 100.0], positions=4,
                                         baseline_lambda=1.0, output=out, mechanism_figure=figure))
    assert figure in written and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.stat().st_size < 100_000
    assert (out / "reads.csv").is_file() and (out / "needle_share_layers.png").is_file()


def test_a_mechanism_figure_path_that_is_no_png_is_refused_before_reading(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ccq_eval import cli
    from ccq_eval.inspection import run as inspect_run

    monkeypatch.setattr(inspect_run, "inspect_model", lambda *a, **k: pytest.fail("a model was read"))
    result = CliRunner().invoke(cli.app, ["inspect", "-m", "tiny-gdn", "--baseline-lambda", "1", "-o",
                                          str(tmp_path / "out"), "--mechanism-figure", str(tmp_path / "mechanism.pdf")])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert f"--mechanism-figure {tmp_path / 'mechanism.pdf'}: give the path of a .png file" in result.output
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
