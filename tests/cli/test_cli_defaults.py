"""`ccq-eval run` defaults that fit the machine (--device / --dtype / --batch-size / --cuda-graphs auto,
with CUDA faked on this CPU), what each unit's meta.json records of them, and `--suite paper`."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import test_cli_run
from test_cli_run import RUN_ARGS, TASK_NAME, FakeLM, invoke

from ccq_eval.cli import common as cli_choices
from ccq_eval.cli import run as run_command
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import runner, store, suites
from ccq_eval.harness.options import DTYPE_CHOICES
from ccq_eval.model import registry as model_registry

fake_world = test_cli_run.fake_world  # the fixture: registry, task catalog and evaluator replaced by fakes


def _plan(**options):
    return run_plan.plan_run(run_plan.RunOptions(models=["tiny-strong"], tasks=["fake"], lengths="1k", **options))


def test_auto_device_and_dtype_follow_cuda(fake_world, monkeypatch):
    for cuda, device, dtype in ((False, "cpu", "float32"), (True, "cuda", "bfloat16")):
        monkeypatch.setattr(run_plan, "cuda_available", lambda cuda=cuda: cuda)
        plan = _plan(output=Path(f"out-{cuda}"))
        assert (plan.device, plan.dtype, plan.units[0].spec["dtype"]) == (device, dtype, dtype)
    # Explicit values win; dtype aliases take torch's name, so one dtype is stored one way.
    plan = _plan(device="cpu", dtype="bf16", output=Path("explicit"))
    assert (plan.device, plan.dtype, plan.units[0].spec["dtype"]) == ("cpu", "bfloat16", "bfloat16")
    assert run_plan.resolve_dtype("auto", "cuda:1") == "bfloat16" and run_plan.resolve_dtype(None, "cpu") == "float32"
    # Under torchrun / accelerate launch, each process takes its own GPU.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_plan.resolve_device("auto") == run_plan.resolve_device("cuda") == "cuda:1"
    assert run_plan.resolve_device("cpu") == "cpu" and run_plan.resolve_device("cuda:0") == "cuda:0"
    # --cuda-graphs where auto found no GPU: refused at planning, naming what was resolved.
    monkeypatch.setattr(run_plan, "cuda_available", lambda: False)
    with pytest.raises(run_plan.PlanError, match="--device auto gave cpu"):
        _plan(cuda_graphs=True, output=Path("graphs"))


def test_meta_records_what_was_asked_and_what_ran(fake_world, monkeypatch):
    """With CUDA faked, a run with no flags asks the adapter for its auto batch size and graphs and
    loads the model on CUDA in bfloat16; meta.json holds both the request and the resolution, the batch
    size as run being the largest batch the adapter ran and batch_sizes_run every batch's rows."""
    from collections import Counter

    from ccq_eval.harness.adapter import resolve_fast_path
    from ccq_eval.harness.batching import AUTO_BATCH_CAP

    class CountingLM(FakeLM):
        """Answers each call as one batch and counts its rows, as the adapter does."""

        def generate_until(self, requests, disable_tqdm=False):
            self.batch_sizes_run[len(requests)] += 1
            return super().generate_until(requests, disable_tqdm)

    monkeypatch.setattr(run_plan, "cuda_available", lambda: True)
    asked, loads, made = [], [], []

    def make_evaluator():
        def make_adapter(model, tokenizer, max_length, batch_size, seed, cuda_graphs):
            asked.append((batch_size, cuda_graphs))
            lm = CountingLM(model, fake_world.calls)
            fixed, lm.cuda_graphs = resolve_fast_path("cuda", True, batch_size, cuda_graphs)
            lm.batch_size, lm.batch_size_auto = fixed or AUTO_BATCH_CAP, fixed is None
            lm.batch_sizes_run = Counter()
            made.append(lm)
            return lm

        return runner.LmEvalUnitEvaluator(
            load_model=lambda source, device, dtype: (loads.append((device, dtype)), (Path(source).name, None))[1],
            make_adapter=make_adapter, task_catalog=run_plan.default_task_catalog())

    monkeypatch.setattr(runner, "default_evaluator", make_evaluator)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "auto")
    assert result.exit_code == 0, result.output
    meta = json.loads(store.unit_dir(Path("auto"), "tiny-strong", TASK_NAME).meta.read_text())
    assert asked == [(None, None)] and loads == [("cuda", "bfloat16")]
    assert {key: meta[key] for key in ("device", "device_requested", "dtype", "dtype_requested", "batch_size",
                                       "batch_size_requested", "cuda_graphs", "cuda_graphs_requested")} == {
        "device": "cuda", "device_requested": "auto", "dtype": "bfloat16", "dtype_requested": "auto",
        "batch_size": max(made[0].batch_sizes_run), "batch_size_requested": "auto", "cuda_graphs": True,
        "cuda_graphs_requested": "auto"}
    assert meta["batch_sizes_run"] == {str(rows): n for rows, n in made[0].batch_sizes_run.items()}
    assert max(made[0].batch_sizes_run) <= AUTO_BATCH_CAP and made[0].batch_sizes_run.total() >= 1
    assert meta["gpu_kernels"] is not None and "--no-cuda-graphs" not in meta["command_line"]

    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "eager", "--no-cuda-graphs", "--batch-size",
                    "2", "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    meta = json.loads(store.unit_dir(Path("eager"), "tiny-strong", TASK_NAME).meta.read_text())
    assert asked[-1] == (2, False) and loads[-1] == ("cuda", "float32")
    assert (meta["cuda_graphs"], meta["cuda_graphs_requested"], meta["batch_size"], meta["dtype"]) == (
        False, False, 2, "float32")
    assert "--no-cuda-graphs" in meta["command_line"]


def test_units_stored_before_dtypes_were_resolved_still_resume(fake_world):
    """A spec stored with dtype None (the old float32 default) matches a CPU run's resolved float32;
    one stored as bf16 does not."""
    plan = _plan(output=Path("old"))
    unit = plan.units[0]
    store.atomic_write_json(unit.dir.results, {"results": {}})  # a finished unit: its spec is checked
    store.atomic_write_json(unit.dir.spec, dict(unit.spec, dtype=None))
    assert _plan(output=Path("old")).units[0].spec["dtype"] == "float32"
    store.atomic_write_json(unit.dir.spec, dict(unit.spec, dtype="bf16"))
    with pytest.raises(run_plan.PlanError, match="dtype: stored 'bfloat16', asked 'float32'"):
        _plan(output=Path("old"))


def test_paper_suite_plans_the_papers_grid(monkeypatch, tmp_path):
    """--suite paper: S-NIAH-1/2/3 at 1K-8K (plus 2x the training context when that is 8K or more),
    both perplexity protocols at 4K-20K, and only the LongBench datasets and zero-shot tasks whose data is found."""
    registry = {name: model_registry.ModelEntry(name, str(tmp_path / name), "") for name in ("base", "ccq")}
    monkeypatch.setattr(run_plan, "load_model_registry", lambda *a, **k: registry)
    monkeypatch.setattr(run_plan, "cuda_available", lambda: False)
    monkeypatch.setattr(suites, "training_context", lambda model: {"ccq": 8192}.get(model.name))
    options = {"models": ["base", "ccq"], "suite": "paper", "output": tmp_path / "out"}

    def hub_unreachable(path, name=None, **kwargs):  # the zero-shot datasets: neither hub nor cache has them
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset_builder", hub_unreachable)

    plan = run_plan.plan_run(run_plan.RunOptions(**options))
    grid = {(u.model, u.task): (u.spec["task_metadata"].get("lengths"), u.spec["max_length"]) for u in plan.units}
    sniah = [f"ccq_s_niah_{k}" for k in (1, 2, 3)]
    ppl = ["ccq_ppl_buckets", "ccq_ppl_sweep"]
    assert sorted(grid) == sorted((m, t) for m in ("base", "ccq") for t in sniah + ppl)
    for task in sniah:
        assert grid["base", task] == ([1024, 2048, 4096, 8192], 8192)
        assert grid["ccq", task] == ([1024, 2048, 4096, 8192, 16384], 16384)  # past its 8K training context
    for task in ppl:
        assert grid["base", task] == grid["ccq", task] == ([4096, 8192, 14336, 20480], 20480)
    assert plan.notes == ["--suite paper: longbench, longbench-e skipped (no --longbench-dir)",
                          "--suite paper: zeroshot skipped (no --zeroshot-dir, and neither the hub nor the datasets "
                          "cache holds the data; docs/zeroshot.md says how to get it)",
                          "--suite paper: recall skipped (no --recall-dir, and neither the hub nor the datasets cache "
                          "holds hazyresearch/based-swde-v2, hazyresearch/based-squad, hazyresearch/based-fda, "
                          "hazyresearch/based_triviaqa, hazyresearch/based_nq_2048, hazyresearch/based_drop; "
                          "docs/recall.md says how to get them)"]

    data = tmp_path / "longbench"
    (data / "data").mkdir(parents=True)
    (data / "qasper.jsonl").write_text("{}\n")
    (data / "data" / "trec_e.jsonl").write_text("{}\n")  # the hub zip's layout
    plan = run_plan.plan_run(run_plan.RunOptions(**options, longbench_dir=data))
    longbench = sorted({u.task for u in plan.units if "longbench" in u.task})
    assert longbench == ["ccq_longbench_e_trec", "ccq_longbench_qasper"]
    assert all(u.spec["task_metadata"] == {"seed": 0} and u.spec["data_files"]  # the data's content, not its folder
               for u in plan.units if "longbench" in u.task)
    assert "datasets skipped (no jsonl file in" in plan.notes[0]

    with pytest.raises(run_plan.PlanError, match="valid suites are paper"):
        run_plan.plan_run(run_plan.RunOptions(models=["base"], suite="nope"))
    with pytest.raises(run_plan.PlanError, match="shorter than ccq_s_niah_1's longest length"):
        run_plan.plan_run(run_plan.RunOptions(**options, max_length=4096))


def test_training_context_comes_from_the_checkpoint_config(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    entry = model_registry.ModelEntry("ckpt", str(folder), "")
    assert suites.training_context(entry) is None  # no config.json
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert suites.training_context(entry) == 4096
    part = suites.SUITES["paper"].parts[0]
    assert suites.suite_lengths(part, entry) == [1024, 2048, 4096, 8192]  # 8K already goes past 4K
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 16384}))
    assert suites.suite_lengths(part, entry) == [1024, 2048, 4096, 8192, 32768]


def test_tasks_lists_the_suites_and_cli_choices_match_the_plan():
    result = invoke("tasks")
    assert result.exit_code == 0, result.output
    listing = result.output.split("Suites (run --suite NAME):")[1]
    assert listing.split()[0] == "paper" and "S-NIAH-1/2/3 at 1K-8K" in listing
    assert [s.value for s in run_command.SuiteName] == list(suites.SUITES)
    assert [d.value for d in cli_choices.Dtype] == list(DTYPE_CHOICES)
