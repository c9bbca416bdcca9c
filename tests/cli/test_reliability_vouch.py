"""Results that vouch for themselves: a finished unit's record (checksums.json) and the aggregates its
samples decide are checked by every reader; what does not agree is refused in one line naming the file.

Results written before the record existed (results/reference, format 1) are checked by recomputing their
aggregates from the samples (tests/cli/test_reliability_aggregates.py checks that for every family).
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest
from test_cli_fakes import SNIAH_TASK, baseline_correct, variant_correct, write_sniah
from test_cli_run import fake_world, invoke  # noqa: F401  (a fixture)
from test_reliability import assert_one_line_error

from ccq_eval.harness import store
from ccq_eval.harness.store import vouch

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"
REFERENCE_UNIT = ("tiny-gdn", "tiny-gdn+ccq-lambda1", "ccq_s_niah_1")


def _reference_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "reference"
    shutil.copytree(REFERENCE, copy)
    return copy


def _swap(first: Path, second: Path) -> None:
    parked = first.with_name(first.name + ".parked")
    first.rename(parked)
    second.rename(first)
    parked.rename(second)


def test_reference_results_read_and_recomputed_as_they_are():
    units = store.load_results(REFERENCE)
    assert units and not any(unit.vouched for unit in units)  # format 1: no record, aggregates recomputed
    assert invoke("table", str(REFERENCE)).exit_code == 0


@pytest.mark.parametrize("command", ["table", "compare"])
def test_swapped_samples_of_two_reference_models_are_refused(tmp_path, command):
    copy = _reference_copy(tmp_path)
    base, variant, task = REFERENCE_UNIT
    first = copy / base / task / f"samples_{task}.jsonl.xz"
    _swap(first, copy / variant / task / f"samples_{task}.jsonl.xz")
    args = ["table", str(copy)] if command == "table" else ["compare", str(copy), "--baseline", base,
                                                            "--variant", variant]
    assert_one_line_error(invoke(*args), f"{base}/{task}/results.json", "mean of its 24 samples",
                          "swapped", "delete")


def test_edited_aggregate_is_refused_not_printed(tmp_path):
    copy = _reference_copy(tmp_path)
    path = copy / "tiny-gdn" / "ccq_s_niah_1" / store.ARCHIVED_RESULTS_FILE  # an archive's results
    results = store.read_json(path)
    results["results"]["ccq_s_niah_1"]["acc_1024,none"] = 99.0
    path.write_bytes(lzma.compress(json.dumps(results).encode("utf-8")))
    result = invoke("table", str(copy), "--view", "tidy")
    assert_one_line_error(result, str(path), "acc_1024 = 99", "mean of its 12 samples is 66.6667")
    assert "99.00" not in result.output


def test_swapped_samples_of_two_recorded_units_are_refused(tmp_path):
    output = tmp_path / "r"
    base, variant = write_sniah(output, "a", baseline_correct), write_sniah(output, "b", variant_correct)
    assert all(store.load_results(output)[i].vouched for i in range(2))
    samples = f"samples_{SNIAH_TASK}.jsonl"
    _swap(base / samples, variant / samples)
    for args in (["table", str(output)], ["compare", str(output), "--baseline", "a", "--variant", "b"],
                 ["archive", str(output), str(tmp_path / "archive")]):
        assert_one_line_error(invoke(*args), str(base / samples), "is not the file its unit wrote", "swapped")
    assert not (tmp_path / "archive").exists()


def test_a_file_edited_after_the_record_is_named(tmp_path):
    unit = write_sniah(tmp_path / "r", "a", baseline_correct)
    meta = unit / store.META_FILE
    meta.write_text(meta.read_text().replace('"a"', '"b"'))
    assert_one_line_error(invoke("table", str(tmp_path / "r")), str(meta), "sha256 differs")


def test_a_unit_moved_under_another_model_is_refused(fake_world):
    from test_reliability import finished_run

    finished_run("out")
    moved = Path("out/other-model")
    Path("out/tiny-strong").rename(moved)
    assert_one_line_error(invoke("table", "out"), "records tiny-strong", "other-model", "move it back")


def test_a_write_stopped_before_results_json_is_redone_and_not_read(fake_world):
    from test_cli_run import RUN_ARGS

    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0
    unit = store.unit_dir(Path("out"), "tiny-strong", "ccq_s_niah_fake")
    unit.results.unlink()  # killed between the record and results.json, which format 4 writes last
    assert_one_line_error(invoke("table", "out"), "holds no results", "ccq-eval run")
    assert store.ResultsStore(Path("out")).on_disk(unit).finished is False
    rerun = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert rerun.exit_code == 0, rerun.output
    assert store.load_results(Path("out"))[0].vouched


def test_a_format_3_write_stopped_before_its_record_is_redone_and_not_read(fake_world):
    from test_cli_run import RUN_ARGS

    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0
    unit = store.unit_dir(Path("out"), "tiny-strong", "ccq_s_niah_fake")
    for path in (unit.spec, unit.meta):  # as format 3 wrote them: results.json first, the record last
        path.write_text(json.dumps(json.loads(path.read_text()) | {"format": 3}))
    (unit.path / vouch.CHECKSUMS_FILE).unlink()  # killed between results.json and the record
    assert_one_line_error(invoke("table", "out"), str(unit.path), "no checksums.json", "rerun")
    assert store.ResultsStore(Path("out")).on_disk(unit).finished is False
    rerun = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert rerun.exit_code == 0, rerun.output
    assert store.load_results(Path("out"))[0].vouched


def _drop_entry(unit: store.UnitDir, name: str) -> None:
    path = unit.path / vouch.CHECKSUMS_FILE
    record = json.loads(path.read_text())
    del record["files"][name]
    path.write_text(json.dumps(record))


# Each way a finished unit's record is thinned out: (what is done, fragments of the one-line refusal).
THINNED = {
    "checksums.json deleted": (lambda unit: (unit.path / vouch.CHECKSUMS_FILE).unlink(),
                               ["no checksums.json", "results format 4", "delete"]),
    "meta.json deleted": (lambda unit: unit.meta.unlink(), ["meta.json is missing", "delete"]),
    "meta.json and checksums.json deleted": (
        lambda unit: (unit.meta.unlink(), (unit.path / vouch.CHECKSUMS_FILE).unlink()),
        ["no checksums.json", "results format 4"]),
    "meta.json, unit.json and checksums.json deleted": (
        lambda unit: (unit.meta.unlink(), unit.spec.unlink(), (unit.path / vouch.CHECKSUMS_FILE).unlink()),
        ["neither meta.json nor unit.json"]),
    "meta.json and its entry deleted": (lambda unit: (unit.meta.unlink(), _drop_entry(unit, "meta.json")),
                                        ["leaves out meta.json"]),
    "entry of results.json dropped": (lambda unit: _drop_entry(unit, "results.json"), ["leaves out results.json"]),
    "entry of meta.json dropped": (lambda unit: _drop_entry(unit, "meta.json"), ["leaves out meta.json"]),
    "entry of unit.json dropped": (lambda unit: _drop_entry(unit, "unit.json"), ["leaves out unit.json"]),
    "entry of the samples dropped": (lambda unit: _drop_entry(unit, "samples_ccq_s_niah_fake.jsonl"),
                                     ["leaves out samples_ccq_s_niah_fake.jsonl"]),
    "samples and their entry deleted": (
        lambda unit: (unit.samples("ccq_s_niah_fake").unlink(), _drop_entry(unit, "samples_ccq_s_niah_fake.jsonl")),
        ["leaves out samples_ccq_s_niah_fake.jsonl"]),
}


@pytest.mark.parametrize("thinning", list(THINNED))
def test_a_thinned_out_record_is_refused_by_every_reader_and_a_rerun(fake_world, thinning):
    from test_cli_run import RUN_ARGS
    from test_reliability import snapshot

    run = invoke(*RUN_ARGS, "--model", "tiny-strong", "--model", "tiny-weak", "--output", "out")
    assert run.exit_code == 0, run.output
    unit = store.unit_dir(Path("out"), "tiny-strong", "ccq_s_niah_fake")
    thin, fragments = THINNED[thinning]
    thin(unit)
    before = snapshot(Path("out"))
    calls = len(fake_world.calls)
    for args in (["table", "out"], ["compare", "out", "--baseline", "tiny-strong", "--variant", "tiny-weak"],
                 ["report", "out"], ["archive", "out", "archived"],
                 [*RUN_ARGS, "--model", "tiny-strong", "--output", "out"]):
        assert_one_line_error(invoke(*args), str(unit.path), *fragments)
    assert snapshot(Path("out")) == before and len(fake_world.calls) == calls  # nothing redone or changed
    assert not Path("archived").exists()


def test_archive_carries_a_record_of_the_archived_files(tmp_path):
    output, archive = tmp_path / "r", tmp_path / "archive"
    write_sniah(output, "a", baseline_correct)
    assert invoke("archive", str(output), str(archive)).exit_code == 0
    (unit,) = store.load_results(archive)
    assert unit.vouched and (unit.folder / vouch.CHECKSUMS_FILE).is_file()
    assert not list(archive.glob(".ccq-archive-*"))  # the temporary folder is gone
    assert invoke("table", str(archive)).output == invoke("table", str(output)).output


@pytest.mark.parametrize("inside", [True, False])
def test_archive_overlapping_its_source_is_refused(tmp_path, inside):
    output = tmp_path / "r"
    unit = write_sniah(output, "a", baseline_correct)
    before = sorted(p.name for p in unit.iterdir())
    source, destination = (output, output / "archive") if inside else (output / "a", output)
    message = "lies inside" if inside else "overlaps its source"  # the command line checks the first
    assert_one_line_error(invoke("archive", str(source), str(destination)), message)
    assert sorted(p.name for p in unit.iterdir()) == before and not (output / "archive").exists()


def test_archive_after_a_killed_archive_removes_its_temporary_folder(tmp_path):
    output, archive = tmp_path / "r", tmp_path / "archive"
    write_sniah(output, "a", baseline_correct)
    stale = archive / ".ccq-archive-999999999" / "a" / SNIAH_TASK  # a pid no process has
    stale.mkdir(parents=True)
    (stale / "results.json").write_text("{}")
    assert invoke("table", str(archive.parent / "r")).exit_code == 0
    result = invoke("archive", str(output), str(archive))
    assert result.exit_code == 0, result.output
    assert not list(archive.glob(".ccq-archive-*")) and len(store.load_results(archive)) == 1


def test_a_rerun_refuses_a_finished_unit_whose_results_were_edited(fake_world):
    from test_cli_run import RUN_ARGS
    from test_reliability import finished_run

    finished_run("out")
    unit = store.unit_dir(Path("out"), "tiny-strong", "ccq_s_niah_fake")
    results = json.loads(unit.results.read_text())
    results["n-samples"] = {}
    unit.results.write_text(json.dumps(results))
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, str(unit.results), "is not the file its unit wrote")


def test_a_rerun_re_hashes_the_samples_of_a_finished_unit(fake_world):
    from test_cli_run import RUN_ARGS
    from test_reliability import finished_run, snapshot

    finished_run("out")
    samples = store.unit_dir(Path("out"), "tiny-strong", "ccq_s_niah_fake").samples("ccq_s_niah_fake")
    samples.write_text(samples.read_text().replace("}\n", "} \n", 1))  # same records, another file
    before = snapshot(Path("out"))
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, str(samples), "is not the file its unit wrote")
    assert snapshot(Path("out")) == before


def test_an_archive_that_fails_midway_leaves_no_partial_unit(tmp_path, monkeypatch):
    from ccq_eval.harness import archive

    output, destination = tmp_path / "r", tmp_path / "archive"
    write_sniah(output, "a", baseline_correct)
    write_sniah(output, "b", variant_correct)
    written = []

    def disk_full_after_three_files(path, data):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        written.append(path)
        Path(path).write_bytes(data)

    monkeypatch.setattr(archive, "atomic_write_bytes", disk_full_after_three_files)
    with pytest.raises(OSError, match="No space left"):
        archive.archive_results(output, destination)
    assert not list(destination.rglob("results.json"))  # nothing a reader would take for a run
    assert not list(destination.glob(".ccq-archive-*"))


@pytest.mark.parametrize("part", ["model", "unit"])
def test_archiving_one_model_or_unit_keeps_its_names(tmp_path, part):
    unit = write_sniah(tmp_path / "r", "a", baseline_correct)
    source = unit.parent if part == "model" else unit
    assert invoke("archive", str(source), str(tmp_path / "archive")).exit_code == 0
    (archived,) = store.load_results(tmp_path / "archive")
    assert archived.folder == tmp_path / "archive" / "a" / SNIAH_TASK and archived.vouched
