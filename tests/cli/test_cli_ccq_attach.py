"""`ccq-eval run --ccq-attach`: training-free CCQ on the embedded plain checkpoints, one model per lambda.

The sweep is run for real (tiny-gla, tiny-gdn, S-NIAH-1 and the perplexity sweep at 1K tokens, a whole
number of 64-token chunks, where the CPU kernels pad nothing): lambda = 0 must give the plain model's
samples bit for bit, lambda = 4 other ones, and every setting is its own unit with its own figure point.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.harness import model_resolution, store, task_selection
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness.options import PlanError, parse_ccq_attach
from ccq_eval.harness.run_options import options_command_line
from ccq_eval.model import loading
from ccq_eval.model import registry as model_registry


def _invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def test_parse_ccq_attach_and_the_names_of_its_models():
    attach = parse_ccq_attach("lambda=4, 0.5,0,2 ; order=2;ccq_form=resolvent; centered=false")
    assert attach.lambdas == (0.0, 0.5, 2.0, 4.0)
    assert attach.fields == {"ccq_order": 2, "ccq_form": "resolvent", "ccq_centered": False}
    assert attach.sweep_name("tiny-gla") == "tiny-gla+ccq-centeredfalse-formresolvent-order2"
    plain = parse_ccq_attach("lambda=0,2,0.25")
    assert [plain.model_name("tiny-gla", lam) for lam in plain.lambdas] == [
        "tiny-gla+ccq-lambda0", "tiny-gla+ccq-lambda0.25", "tiny-gla+ccq-lambda2"]
    assert store.slugify("tiny-gla+ccq-lambda2") == "tiny-gla+ccq-lambda2"  # the folder name


@pytest.mark.parametrize("lam", [0.0, 0.1, 0.5, 2.0, 4.0])
def test_the_constant_gate_gives_exactly_lambda(lam):
    """lambda_t = ccq_lambda_max * sigmoid(b) as the read computes it (fp32) is the asked value exactly."""
    import torch

    from ccq_eval.model.ccq import CCQGate

    fields = loading.constant_gate_fields(lam)
    bias = torch.full((3,), fields["ccq_gate_bias_init"])
    values = CCQGate(None, bias, fields["ccq_lambda_max"]).values(torch.zeros(1, 5, 3, 4))
    assert torch.equal(values, torch.full_like(values, lam))


@pytest.mark.parametrize(("models", "attach", "expected"), [
    (["tiny-gla"], "lambda=abc", "lambda 'abc' is not a number"),
    (["tiny-gla"], "lambda=1,-2", "lambda '-2' must be a finite number >= 0"),
    (["tiny-gla"], "lambda=1,1.0", "repeats a value"),
    (["tiny-gla"], "order=2", "has no lambda values"),
    (["tiny-gla"], "lambda=1;order=1,2", "only lambda takes a list"),
    (["tiny-gla"], "lambda=1;orderr=2", "unknown CCQ config field ccq_orderr; valid: order"),
    (["tiny-gla"], "lambda=1;lambda_max=8", "ccq_lambda_max cannot be set in a CCQ attachment"),
    (["tiny-gla"], "lambda=1;order=0", "ccq_order must be an integer >= 1, got 0"),
    (["tiny-gla-ccq"], "lambda=1", "tiny-gla-ccq: it is a CCQ checkpoint already"),
    (["tiny-gdn", "tiny-transformer"], "lambda=1", "a llama model has no CCQ"),
    ([], "lambda=1", "--ccq-attach needs --model"),
])
def test_bad_attachments_fail_in_one_line_before_any_model_loads(models, attach, expected, monkeypatch, tmp_path):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_model", no_loading)
    args = [arg for model in models for arg in ("--model", model)]
    result = _invoke("run", *args, "--ccq-attach", attach, "--task", "ppl-sweep", "--lengths", "640",
                     "--output", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    [error] = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert expected in error and "--ccq-attach" in error, error
    assert not (tmp_path / "out").exists()


def test_each_setting_is_its_own_unit_and_resumes_as_itself(tmp_path):
    """The plan gives every lambda > 0 its own folder and a spec that records the attachment (so a resumed
    or re-run unit is never another setting's), while the checkpoint fingerprint stays the plain one; the
    plain model is planned once under its own name as the sweep's lambda = 0, with the spec of a plain run."""
    options = run_plan.RunOptions(models=["tiny-gla"], tasks=["ppl-sweep"], lengths="640", output=tmp_path,
                                  ccq_attach="lambda=0,0.5,4;decay=none")
    plan = run_plan.plan_run(options)
    assert [unit.model for unit in plan.units] == ["tiny-gla", "tiny-gla+ccq-decaynone-lambda0.5",
                                                   "tiny-gla+ccq-decaynone-lambda4"]
    assert [unit.dir.path.parent.name for unit in plan.units] == [unit.model for unit in plan.units]
    assert [unit.spec.get("ccq_attach") for unit in plan.units] == [None] + [
        {"sweep": "tiny-gla+ccq-decaynone", "lambda": lam, "fields": {"ccq_decay": "none"}, "baseline": "tiny-gla"}
        for lam in (0.5, 4.0)]
    plain = run_plan.plan_run(run_plan.RunOptions(models=["tiny-gla"], tasks=["ppl-sweep"], lengths="640",
                                                  output=tmp_path))
    assert [unit.spec for unit in plain.units] == [plan.units[0].spec]  # one unit, asked either way
    assert plan.units[0].spec["checkpoint"] == plan.units[2].spec["checkpoint"] is not None
    assert "--ccq-attach" in options_command_line(options)
    # A folder holding another setting's answers is refused, not resumed.
    first = plan.units[1]
    first.dir.path.mkdir(parents=True)
    store.atomic_write_json(first.dir.spec, plan.units[2].spec)
    store.atomic_write_json(first.dir.results, {"results": {}})
    with pytest.raises(PlanError, match=r"different settings.*ccq_attach"):
        run_plan.plan_run(options)


def test_the_default_run_adds_a_training_free_sweep_of_each_twin_s_baseline(tmp_path):
    """`ccq-eval run` with no --model / --task: the default models on the default tasks, and each default
    model that has its CCQ twin among the defaults once more per DEFAULT_SWEEP_ATTACH lambda, on
    DEFAULT_SWEEP_TASKS with the same documents (task metadata) as its plain units."""
    plan = run_plan.plan_run(run_plan.RunOptions(output=tmp_path))
    registry = run_plan.load_model_registry()
    defaults = model_registry.default_model_names(registry)
    baselines = [name for name in defaults if f"{name}-ccq" in defaults]
    assert baselines  # the embedded twins
    lambdas = parse_ccq_attach(model_resolution.DEFAULT_SWEEP_ATTACH).lambdas
    sweep_tasks = [task for alias in task_selection.DEFAULT_SWEEP_TASKS
                   for task in run_plan.default_task_catalog().resolve(alias)]
    expected_sweep = {(f"{name}+ccq-lambda{lam:g}", task) for name in baselines for lam in lambdas if lam
                      for task in sweep_tasks}
    units = {(unit.model, unit.task): unit for unit in plan.units}
    assert len(units) == len(plan.units)  # no unit planned twice: the baselines are the plain default models
    plain = {key for key, unit in units.items() if "ccq_attach" not in unit.spec}
    assert {model for model, _ in plain} == set(defaults)
    assert set(units) - plain == expected_sweep
    for model, task in expected_sweep:
        attach = units[model, task].spec["ccq_attach"]
        baseline = units[attach["baseline"], task]
        assert attach["sweep"] == f"{attach['baseline']}+ccq" and attach["lambda"] > 0
        assert units[model, task].spec["task_metadata"] == baseline.spec["task_metadata"]
        assert units[model, task].spec["checkpoint"] == baseline.spec["checkpoint"]
    # Naming models or tasks asks for exactly those: no sweep.
    named = run_plan.plan_run(run_plan.RunOptions(models=defaults, output=tmp_path))
    assert not [unit for unit in named.units if "ccq_attach" in unit.spec]


@pytest.mark.parametrize("base", ["tiny-gla", "tiny-gdn"])
@pytest.mark.parametrize("fields", [{}, {"ccq_form": "resolvent", "ccq_solve_steps": 8}, {"ccq_order": 3}])
def test_an_attachment_at_lambda_zero_computes_the_plain_logits(base, fields):
    """Bit for bit on CPU, for every read form the config offers (fields pass through to it as given);
    at lambda = 2 the read changes the logits."""
    import torch

    tokens = torch.randint(3, 300, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = loading.load_model(base)[0](tokens).logits
        attached = {lam: loading.load_model(base, ccq_lambda=lam, ccq_fields=fields)[0] for lam in (0.0, 2.0)}
        assert all(model.config.ccq and model.config.ccq_gate == "constant" for model in attached.values())
        assert torch.equal(attached[0.0](tokens).logits, plain)
        assert not torch.allclose(attached[2.0](tokens).logits, plain, atol=1e-3)


def test_unknown_values_of_a_passed_through_field_are_the_config_s_error(tmp_path):
    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=["ppl-sweep"], lengths="1k", output=tmp_path,
                                  ccq_attach="lambda=1;form=bogus")
    with pytest.raises(PlanError, match=r"--ccq-attach: .*ccq_form must be one of"):
        run_plan.plan_run(options)


@pytest.mark.slow
def test_sweep_on_the_embedded_models_evaluates_the_plain_model_once(tmp_path):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a busy 2-core machine
    out = tmp_path / "results"
    common = ["--model", "tiny-gla", "--model", "tiny-gdn", "--task", "s-niah-1", "--task", "ppl-sweep",
              "--lengths", "1k", "--depths", "50", "--samples-per-cell", "1", "--output", str(out), "--quiet",
              "--lm-eval-arg", "bootstrap_iters=0"]
    sweep = ["run", *common, "--ccq-attach", "lambda=0,4"]
    try:
        result = _invoke(*sweep, "--no-report")
        assert result.exit_code == 0, result.output
        assert "8 evaluated" in result.output  # 2 checkpoints x (plain, lambda 4) x 2 tasks
        result = _invoke("run", *common)  # the plain checkpoints asked again: the sweep computed them
        assert result.exit_code == 0, result.output
        assert "0 evaluated, 4 skipped" in result.output, result.output
    finally:
        torch.set_num_threads(previous)

    tasks = ("ccq_s_niah_1", "ccq_ppl_sweep")
    for base in ("tiny-gla", "tiny-gdn"):
        assert sorted(p.name for p in out.glob(f"{base}*")) == [base, f"{base}+ccq-lambda4"]
        configs = set()
        for task in tasks:
            plain, four = (out / name / task for name in (base, f"{base}+ccq-lambda4"))
            meta = json.loads((four / "meta.json").read_text())
            assert meta["spec"]["ccq_attach"] == {"sweep": f"{base}+ccq", "lambda": 4.0, "fields": {},
                                                  "baseline": base}
            assert "ccq_attach" not in json.loads((plain / "meta.json").read_text())["spec"]
            configs |= {json.loads((folder / "meta.json").read_text())["model_config_sha256"]
                        for folder in (plain, four)}
            answers = {folder: [(s["doc_hash"], s["resps"], s["filtered_resps"]) for s in map(
                json.loads, (folder / f"samples_{task}.jsonl").read_text().splitlines())] for folder in (plain, four)}
            assert [a[0] for a in answers[four]] == [a[0] for a in answers[plain]]  # the same documents
            assert answers[four] != answers[plain], (base, task)  # CCQ at lambda = 4 reads differently
        assert len(configs) == 2  # plain and lambda 4 are two configurations

    # Re-running the sweep finds every setting finished; `figures` draws one score-vs-lambda figure per sweep,
    # its lambda = 0 the plain model; `compare` pairs lambda 4 with it.
    result = _invoke(*sweep, "--no-report")
    assert result.exit_code == 0 and "0 evaluated, 8 skipped" in result.output, result.output
    result = _invoke("figures", str(out), "--output", str(tmp_path / "figures"))
    assert result.exit_code == 0, result.output
    drawn = sorted(p.name for p in (tmp_path / "figures").glob("ccq_sweep_*.png"))
    assert drawn == ["ccq_sweep_tiny-gdn_ccq.png", "ccq_sweep_tiny-gla_ccq.png"]
    result = _invoke("compare", str(out), "--n-boot", "100")
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("### ")] == [
        "### tiny-gdn+ccq-lambda4 vs tiny-gdn", "### tiny-gla+ccq-lambda4 vs tiny-gla"]
