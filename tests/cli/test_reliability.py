"""Fault injection: every way a careful user broke `ccq-eval` (issue 21) ends in one clear line or a
correct recovery, and never changes a stored result.

Each test breaks one thing (a name, a file, a checkpoint, a folder) and checks: the exit status, that
the message is one line naming what was wrong and what to do, that no traceback is printed, and
that the stored units are byte for byte what they were. The runs use test_cli_run's fake world (the
real lm_eval.simple_evaluate, a fake model); the multi-process cases run fake_worker.py processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_cli_run import N_DOCS, REGISTRY, RUN_ARGS, TASK_NAME, FakeCatalog, fake_world, invoke  # noqa: F401

from ccq_eval import atomic_io
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import resume, store
from ccq_eval.model import registry as model_registry

HERE = Path(__file__).resolve().parent


def snapshot(root: Path) -> dict[str, bytes]:
    """Every stored unit file below `root` (results, metadata, samples, spec)."""
    names = (store.RESULTS_FILE, store.META_FILE, store.UNIT_SPEC_FILE)
    return {str(p): p.read_bytes() for p in sorted(Path(root).rglob("*"))
            if p.is_file() and (p.name in names or p.name.startswith("samples_"))}


def assert_one_line_error(result, *fragments: str, code: int = 2) -> str:
    """Exit `code`, no traceback, and the error is a single line holding every fragment."""
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    following = result.output.split(errors[0], 1)[1].strip()
    assert following == "", f"the error continues on another line: {following!r}"
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def make_checkpoint(folder: Path, value: float = 1.0, size: int = 1000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "gla"}')
    save_file({"w": np.full(size, value, dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def finished_run(output: str = "out", *extra: str) -> dict[str, bytes]:
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", *extra, "--output", output)
    assert result.exit_code == 0, result.output
    return snapshot(Path(output))


# 1 -------------------------------------------------------------------------------------------


def test_two_checkpoints_sharing_a_results_folder_are_refused(fake_world, tmp_path):
    make_checkpoint(tmp_path / "slug" / "gla v1", 1.0)
    make_checkpoint(tmp_path / "slug" / "gla_v1", 2.0)
    before = finished_run("out")
    fake_world.loads.clear()
    result = invoke(*RUN_ARGS, "-m", str(tmp_path / "slug" / "gla v1"), "-m", str(tmp_path / "slug" / "gla_v1"),
                    "--output", "out")
    assert_one_line_error(result, "would share the results folder 'gla_v1'", "rename one")
    assert fake_world.loads == [] and snapshot(Path("out")) == before


def test_resume_cache_of_another_unit_is_never_read(tmp_path):
    cache = store.ResponseCache(tmp_path / "r.sqlite", identity="model-a")
    cache.put_many([("k", {"text": "from model a"})])
    cache.close()
    with pytest.raises(store.ResultsError, match="answers of another model or other settings"):
        store.ResponseCache(tmp_path / "r.sqlite", identity="model-b")
    reopened = store.ResponseCache(tmp_path / "r.sqlite", identity="model-a")
    assert reopened.get_many(["k"]) == {"k": {"text": "from model a"}}


# 2 -------------------------------------------------------------------------------------------


def test_checkpoint_changed_in_the_middle_is_not_taken_for_the_old_one(fake_world, monkeypatch, tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", 1.0, size=1_500_000)  # 6 MB: head and tail MiB stay
    registry = dict(REGISTRY, **{"tiny-strong": model_registry.ModelEntry("tiny-strong", str(folder), "", True)})
    monkeypatch.setattr(run_plan, "load_model_registry", lambda *a, **k: registry)
    before = finished_run("out")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + (1 << 20)] = bytes(1 << 20)  # 1 MiB zeroed in the middle, same size
    weights.write_bytes(bytes(data))
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, "different settings (checkpoint:", "use another --output")
    assert snapshot(Path("out")) == before


def test_large_file_hash_is_cached_by_size_and_times(monkeypatch, tmp_path):
    from ccq_eval.model import checkpoint

    monkeypatch.setenv("CCQ_EVAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoint, "_CACHE_MIN_BYTES", 10)
    path = tmp_path / "w.bin"
    path.write_bytes(b"a" * 100)
    first = checkpoint.file_sha256(path)
    cache = tmp_path / "cache" / "file_sha256.json"
    (key,) = json.loads(cache.read_text())
    cache.write_text(json.dumps({key: "remembered"}))
    assert checkpoint.file_sha256(path) == "remembered"  # an unchanged file is not read again
    time.sleep(0.01)
    path.write_bytes(b"b" * 100)  # same size, rewritten: ctime moves, so the cached hash is not used
    assert checkpoint.file_sha256(path) not in (first, "remembered")


# 3 -------------------------------------------------------------------------------------------


def test_archive_never_mixes_into_a_live_run(fake_world):
    finished_run("src")
    live = finished_run("live")
    result = invoke("archive", "src", "live")
    assert_one_line_error(result, "holds a live run", "archive into a new folder")
    assert snapshot(Path("live")) == live
    assert invoke("archive", "src", "packed").exit_code == 0
    assert invoke("archive", "src", "packed").exit_code == 0  # an archive may be refreshed


# 4 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["table", "compare"])
def test_samples_cut_at_a_line_boundary_are_detected(fake_world, command):
    finished_run("out", "--model", "tiny-weak")
    finished_run("out2")
    samples = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME).samples(TASK_NAME)
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(lines[:-3]))
    args = ["table", "out"] if command == "table" else ["compare", "out", "--baseline", "tiny-strong",
                                                        "--variant", "tiny-weak"]
    result = invoke(*args)
    assert_one_line_error(result, str(samples), f"holds {N_DOCS - 3} samples", f"records {N_DOCS}", "delete")
    # an edited sample (same count) is found through the task hash results.json stores
    other = store.unit_dir(Path("out2"), "tiny-strong", TASK_NAME).samples(TASK_NAME)
    first = json.loads(other.read_text().splitlines()[0])
    edited = [json.dumps(first | {"doc_hash": "0" * 64}), *other.read_text().splitlines()[1:]]
    other.write_text("\n".join(edited) + "\n")
    assert_one_line_error(invoke("table", "out2"), "task hash differs")


# 5 -------------------------------------------------------------------------------------------


def test_run_after_a_corrupt_samples_file_reports_in_one_line(fake_world):
    finished_run("out")
    samples = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME).samples(TASK_NAME)
    samples.write_text(samples.read_text()[:-40])
    before = snapshot(Path("out"))
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, str(samples), "not valid JSON")  # the rerun checks a finished unit's files
    assert snapshot(Path("out")) == before


def test_run_after_a_corrupt_meta_file_is_refused_in_one_line(fake_world):
    finished_run("out")
    meta = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME).meta
    meta.write_text('{"model": ')
    before = snapshot(Path("out"))
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, str(meta), "not valid JSON", "fix or delete")
    assert snapshot(Path("out")) == before


def test_run_on_a_read_only_finished_store(fake_world, monkeypatch):
    before = finished_run("out")
    fake_world.loads.clear()

    def read_only(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(atomic_io, "atomic_write_text", read_only)  # root ignores chmod
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, "Permission denied", "ccq-eval table out", code=1)
    assert fake_world.loads == [] and snapshot(Path("out")) == before


# 6, 11, 12 (names and paths) ---------------------------------------------------------------


@pytest.mark.parametrize(("args", "fragments"), [
    (["-m", "/"], ["filesystem root is not a checkpoint folder"]),
    (["--lengths", ""], ["--lengths is empty"]),
    (["--depths", " "], ["--depths is empty"]),
    (["--output", "afile"], ["afile is a file, not a folder"]),
    (["--output", "afile/sub"], ["afile is a file, not a folder"]),
    (["--shard", "4/3"], ["1 <= K <= N"]),
])
def test_bad_names_and_paths_fail_in_one_line_before_any_model_loads(fake_world, args, fragments):
    Path("afile").write_text("not a folder")
    assert_one_line_error(invoke(*RUN_ARGS, "--model", "tiny-strong", *args), *fragments)
    assert fake_world.loads == []


@pytest.mark.parametrize(("damage", "fragments"), [
    ("truncate", ["model.safetensors is truncated", "re-download or re-save"]),
    ("random", ["model.safetensors is not a safetensors file", "re-download or re-save"]),
    ("pickle", ["only pickle weights", "model.safetensors", "save_pretrained"]),
    ("no-config", ["no config.json", "save_pretrained"]),
])
def test_broken_checkpoint_folders_are_named_before_loading(fake_world, tmp_path, damage, fragments):
    folder = make_checkpoint(tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "random":
        weights.write_bytes(os.urandom(5000))
    elif damage == "pickle":
        weights.rename(folder / "pytorch_model.bin")
    else:
        (folder / "config.json").unlink()
    line = assert_one_line_error(invoke(*RUN_ARGS, "--model", str(folder)), str(folder), *fragments)
    assert "--allow-pickle" not in line  # case 8: no advice to use a flag that does not exist
    assert fake_world.loads == []


def test_config_that_does_not_match_the_weights_is_named(tmp_path):
    import shutil

    from ccq_eval.model.loading import ModelLoadError, load_model

    folder = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).resolve().parents[2] / "models" / "tiny-gla", folder)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(folder))
    message = str(error.value)
    assert str(folder) in message and "does not match" in message and "\n" not in message


# 7 -------------------------------------------------------------------------------------------


def test_truncated_resume_cache_is_named_before_any_model_loads(fake_world):
    fake_world.fail_after = 7
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 1
    database = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME).responses_db
    database.write_bytes(database.read_bytes()[: database.stat().st_size // 2])
    fake_world.fail_after, fake_world.loads[:] = None, []
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, str(database), "truncated or corrupt", "delete it")
    assert fake_world.loads == []
    database.unlink()  # the advice works
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0


# 9 -------------------------------------------------------------------------------------------


def test_longbench_without_its_data_fails_before_the_model_loads(fake_world, monkeypatch, tmp_path):
    class LongBench(FakeCatalog):
        def resolve(self, name):
            return ["ccq_longbench_qasper", "ccq_longbench_e_qasper"]

    monkeypatch.setattr(run_plan, "default_task_catalog", lambda: LongBench(Path(".")))
    assert_one_line_error(invoke("run", "-m", "tiny-strong", "-t", "longbench"), "--longbench-dir FOLDER")
    (tmp_path / "lb").mkdir()
    (tmp_path / "lb" / "qasper.jsonl").write_text("{}\n")
    result = invoke("run", "-m", "tiny-strong", "-t", "longbench", "--longbench-dir", str(tmp_path / "lb"))
    assert_one_line_error(result, "lacks the jsonl file of ccq_longbench_e_qasper", "unzip")
    assert fake_world.loads == []


# 10 ------------------------------------------------------------------------------------------


def test_failed_run_does_not_block_the_corrected_command(fake_world):
    fake_world.fail_after = 0  # fails before answering anything, as a run with an impossible length
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 1
    fake_world.fail_after = None
    corrected = [a if a != "1k,2k" else "1k" for a in RUN_ARGS]
    result = invoke(*corrected, "--model", "tiny-strong", "--output", "out")
    assert result.exit_code == 0, result.output
    spec = json.loads(store.unit_dir(Path("out"), "tiny-strong", TASK_NAME).spec.read_text())
    assert spec["task_metadata"]["lengths"] == [1024]


def test_partly_answered_run_with_other_settings_is_still_refused(fake_world):
    fake_world.fail_after = 4
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 1
    fake_world.fail_after = None
    corrected = [a if a != "1k,2k" else "1k" for a in RUN_ARGS]
    assert_one_line_error(invoke(*corrected, "--model", "tiny-strong", "--output", "out"), "different settings")


# 14 ------------------------------------------------------------------------------------------


def test_sampled_repeats_keep_their_own_answers_on_resume(tmp_path):
    class Request:
        def __init__(self, prompt):
            self.args, self.doc = (prompt, {"do_sample": True, "temperature": 1.0}), {}

    class Sampler:
        calls = 0

        def generate_until(self, requests):
            Sampler.calls += len(requests)
            return [f"draw {Sampler.calls - len(requests) + i}" for i in range(len(requests))]

    request = Request("same prompt")
    cache = store.ResponseCache(tmp_path / "r.sqlite")
    first = resume.ResumableLM(Sampler(), cache).generate_until([request] * 3)  # lm-eval's repeats: 3
    assert len(set(first)) == 3
    again = resume.ResumableLM(Sampler(), cache).generate_until([request] * 3)
    assert again == first and Sampler.calls == 3


# 15 ------------------------------------------------------------------------------------------


def test_results_files_follow_the_umask(fake_world):
    finished_run("out")
    umask = os.umask(0)
    os.umask(umask)
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    for path in (unit.results, unit.meta, unit.spec, unit.samples(TASK_NAME)):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


# Tracebacks: unexpected errors are one line too -----------------------------------------------


def test_unexpected_errors_are_one_line_unless_debugging(fake_world, monkeypatch):
    def broken(options):
        raise KeyError("surprise")

    monkeypatch.setattr(run_plan, "plan_run", broken)
    assert_one_line_error(invoke(*RUN_ARGS), "KeyError: 'surprise'", "CCQ_EVAL_DEBUG=1", code=1)
    monkeypatch.setenv("CCQ_EVAL_DEBUG", "1")
    assert isinstance(invoke(*RUN_ARGS).exception, KeyError)
    monkeypatch.delenv("CCQ_EVAL_DEBUG")
    assert isinstance(invoke("--verbosity", "debug", *RUN_ARGS).exception, KeyError)


# 13 and issue 19 part 5: several workers on one results folder --------------------------------

GRID = ["run", "-m", "tiny-strong", "-m", "tiny-weak", "-m", "tiny-other", "-t", "grid", "--lengths", "1k",
        "--depths", "0,100", "--samples-per-cell", "2", "--lm-eval-arg", "bootstrap_iters=0", "--quiet"]
GRID_DOCS = 4  # requests per unit: 1 length x 2 depths x 2 samples


def _workers(tmp_path: Path, commands: list[list[str]], delay: float) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    return [subprocess.Popen([sys.executable, str(HERE / "fake_worker.py"), str(tmp_path), str(tmp_path / "log"),
                              str(delay), *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for command in commands]


def _finish(workers: list[subprocess.Popen]) -> list[str]:
    outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    for worker, output in zip(workers, outputs):
        assert worker.returncode == 0, output
    return outputs


def _computed(tmp_path: Path) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for line in (tmp_path / "log").read_text().splitlines():
        model, task, _ = line.split("\t", 2)
        counts[(model, task)] = counts.get((model, task), 0) + 1
    return counts


@pytest.fixture
def grid_world(tmp_path):
    import fake_worker

    fake_worker.write_tasks(tmp_path / "tasks")
    return fake_worker


@pytest.mark.slow
def test_three_workers_compute_every_unit_once_and_write_the_same_table(grid_world, tmp_path):
    _finish(_workers(tmp_path, [[*GRID, "-o", "single"]], delay=0.0))
    units = {(m, t) for m in ("tiny-strong", "tiny-weak", "tiny-other") for t in grid_world.TASKS}
    for output, shard in (("locks", False), ("shards", True)):  # claiming units by lock; a Slurm array
        (tmp_path / "log").unlink()
        commands = [GRID + ["-o", output] + (["--shard", f"{k}/3"] if shard else []) for k in (1, 2, 3)]
        outputs = _finish(_workers(tmp_path, commands, delay=0.05))
        assert _computed(tmp_path) == {unit: GRID_DOCS for unit in units}  # every unit once, by one worker
        assert all("evaluated" in o for o in outputs)
        assert (tmp_path / output / "table.md").read_text() == (tmp_path / "single" / "table.md").read_text()


@pytest.mark.slow
def test_killed_worker_leaves_no_stale_lock_and_resumes(grid_world, tmp_path):
    command = ["run", "-m", "tiny-strong", "-t", TASK_NAME, *GRID[9:], "-o", "out"]
    worker = _workers(tmp_path, [command], delay=0.5)[0]
    deadline = time.time() + 120
    while time.time() < deadline and len(_computed(tmp_path) if (tmp_path / "log").exists() else {}) == 0:
        time.sleep(0.2)
    time.sleep(0.6)
    worker.kill()  # kill -9 mid-unit, holding the unit's lock
    worker.wait()
    answered = sum(_computed(tmp_path).values())
    assert 0 < answered < GRID_DOCS
    _finish(_workers(tmp_path, [command], delay=0.0))
    assert sum(_computed(tmp_path).values()) <= GRID_DOCS + 1  # at most the request in flight is redone
    unit = store.unit_dir(tmp_path / "out", "tiny-strong", TASK_NAME)
    assert json.loads(unit.results.read_text())["n-samples"][TASK_NAME]["effective"] == GRID_DOCS


# 16, 17: byte-level tokenizers never cut inside a character --------------------------------


def test_perplexity_pieces_end_on_character_boundaries(tmp_path):
    from adapter_support import byte_tokenizer, ppl_utils

    utils = ppl_utils()
    tokenizer = byte_tokenizer()
    text = "ab" + "é中玉𝄞" * 40  # 2-, 3- and 4-byte characters: most 16-token cuts fall inside one
    (tmp_path / "doc.txt").write_text(text)
    metadata = {"tokenizer": tokenizer, "data_files": str(tmp_path / "doc.txt"), "lengths": [16]}
    blocks = utils.bucket_documents(**metadata)["test"]
    stream = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    joined = [i for block in blocks for i in tokenizer.encode(block["text"], add_special_tokens=False)]
    assert all(block["roundtrip_exact"] for block in blocks)
    assert all(13 <= block["n_text_tokens"] <= 16 for block in blocks)
    assert joined == stream[: len(joined)] and len(stream) - len(joined) < 16  # no byte lost between blocks
    for row in utils.sweep_documents(**metadata)["test"]:
        assert row["roundtrip_exact"] and text.startswith(row["text"])


def test_middle_truncation_keeps_only_characters_of_the_source():
    import torch
    from adapter_support import byte_tokenizer, tiny_model
    from ccq_eval.tasks.longbench import utils as longbench

    from ccq_eval.harness.adapter import CCQEvalLM

    record = json.loads((HERE.parent / "fixtures" / "longbench" / "multifieldqa_zh.jsonl").read_text().splitlines()[0])
    prompt = longbench.doc_to_text(record | {"ccq_dataset": "multifieldqa_zh"})  # 260 bytes
    tokenizer = byte_tokenizer()
    adapter = CCQEvalLM(model=tiny_model(tokenizer, dtype=torch.float32), tokenizer=tokenizer, max_length=4096)
    ids = adapter.tok_encode(prompt)
    kept = adapter.truncator.fit(ids, 200, "middle", "ccq_longbench_multifieldqa_zh", "a 200-token budget")
    assert 194 <= len(kept) <= 200
    text = tokenizer.decode(kept, skip_special_tokens=False)
    assert adapter.tok_encode(text) == kept  # whole characters only: no byte joins another's
    split = next(n for n in range(len(text) + 1) if prompt.startswith(text[:n]) and prompt.endswith(text[n:]))
    assert 0 < split < len(text)  # a head of the source and a tail of the source, nothing else
    adapter.truncator.max_length = 512  # gov_report's answers take 512 new tokens: no room for a prompt
    with pytest.raises(ValueError, match=r"needs a max length above 512 \(e.g. --max-length 2560"):
        adapter.truncator.fit(ids, 0, "middle", "ccq_longbench_gov_report", "max_length 512 minus max_gen_toks 512")
