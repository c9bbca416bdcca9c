"""The results store's files: format versions of unit.json and meta.json, one reader per version.

Version 1 is what the store wrote before the files named their format (results/reference holds such
units); version 2 named it; version 3 adds each finished unit's checksums.json; version 4, what it writes
now, writes that record before results.json and refuses a record that leaves out a file the format
requires; a later version is refused with one line naming the file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ccq_eval.harness import store
from ccq_eval.harness.store import formats

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"
SPEC = {"model": "m", "checkpoint": None, "task": "t", "task_metadata": {"seed": 0}, "limit": None,
        "dtype": "float32", "max_length": 1024, "lm_eval_args": {}}
RESULTS = {"results": {"t": {"acc,none": 50.0}}, "n-samples": {"t": {"original": 1, "effective": 1}}}
SAMPLE = {"doc_id": 0, "doc": {"x": 1}, "target": "a", "arguments": [("p",)], "resps": [["a"]],
          "filtered_resps": ["a"], "acc": 100.0}


def _write(tmp_path: Path) -> store.UnitDir:
    results_store = store.ResultsStore(tmp_path / "out")
    unit = results_store.unit("m", "t")
    results_store.open(unit, SPEC).close()
    assert results_store.commit(unit, "m", RESULTS, {"t": [SAMPLE]}, {"model": "m", "spec": SPEC}) is None
    return unit


def test_written_files_name_their_format_and_read_back_as_written(tmp_path):
    unit = _write(tmp_path)
    for path in (unit.spec, unit.meta):
        content = json.loads(path.read_text())
        assert next(iter(content)) == formats.FORMAT_KEY and content[formats.FORMAT_KEY] == formats.FORMAT_VERSION
    assert formats.read_spec(unit.spec) == SPEC  # the settings without the format key: planning compares them
    assert store.ResultsStore(tmp_path / "out").on_disk(unit) == store.UnitOnDisk(True, SPEC, 0)
    (loaded,) = store.load_results(tmp_path / "out")
    assert loaded.spec == SPEC and loaded.meta["spec"] == SPEC and loaded.samples("t")[0]["acc"] == 100.0
    assert not unit.responses_db.exists()  # a stored unit keeps no resume cache


def test_reference_results_without_a_format_are_read_as_version_one():
    units = store.load_results(REFERENCE)
    assert len(units) == len(list(REFERENCE.rglob("results.json.xz"))) > 0  # an archive: compressed results
    for unit in units:
        written = json.loads((unit.folder / store.UNIT_SPEC_FILE).read_text())
        assert formats.FORMAT_KEY not in written and unit.spec == written  # version 1: read as it is
        assert unit.meta["spec"] == written


@pytest.mark.parametrize(("stored", "read"), [(None, "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                              ("float32", "float32")])
def test_version_one_dtypes_read_as_their_torch_names(tmp_path, stored, read):
    path = tmp_path / store.UNIT_SPEC_FILE
    path.write_text(json.dumps(dict(SPEC, dtype=stored)))
    assert formats.read_spec(path) == dict(SPEC, dtype=read)


def test_version_one_unit_without_unit_json_takes_its_settings_from_meta(tmp_path):
    unit = _write(tmp_path)
    unit.spec.unlink()
    (unit.path / "checksums.json").unlink()  # version 1 units have no record
    unit.meta.write_text(json.dumps({"model": "m", "spec": dict(SPEC, dtype=None)}))  # version 1: no format key
    assert store.ResultsStore(tmp_path / "out").on_disk(unit).spec == SPEC


@pytest.mark.parametrize("name", [store.UNIT_SPEC_FILE, store.META_FILE])
def test_a_newer_format_is_refused_in_one_line_naming_the_file(tmp_path, name):
    unit = _write(tmp_path)
    path = unit.path / name
    path.write_text(json.dumps(json.loads(path.read_text()) | {formats.FORMAT_KEY: formats.FORMAT_VERSION + 1}))
    readers = [lambda: store.ResultsStore(tmp_path / "out").on_disk(unit)]
    if name == store.META_FILE:
        readers.append(lambda: store.load_results(tmp_path / "out"))
    else:
        readers.append(lambda: store.load_results(tmp_path / "out")[0].spec)
    for read in readers:
        with pytest.raises(store.ResultsError) as error:
            read()
        message = str(error.value)
        assert str(path) in message and "upgrade ccq-eval" in message and "\n" not in message


@pytest.mark.parametrize("value", ["2", 0, True, 1.5])
def test_a_format_that_is_no_version_is_refused(tmp_path, value):
    path = tmp_path / store.META_FILE
    path.write_text(json.dumps({formats.FORMAT_KEY: value}))
    with pytest.raises(store.ResultsError, match="is not a format version"):
        formats.read_meta(path)


def test_archived_units_keep_their_format(tmp_path):
    from ccq_eval.harness.archive import archive_results

    unit = _write(tmp_path)
    archive_results(tmp_path / "out", tmp_path / "archive")
    copy = tmp_path / "archive" / unit.path.relative_to(tmp_path / "out")
    assert (copy / store.UNIT_SPEC_FILE).read_bytes() == unit.spec.read_bytes()
    shutil.rmtree(tmp_path / "out")
    (loaded,) = store.load_results(tmp_path / "archive")
    assert loaded.spec == SPEC


@pytest.mark.parametrize("name", [store.ARCHIVED_RESULTS_FILE, "samples_t.jsonl.xz", store.META_FILE])
def test_an_archived_unit_whose_record_leaves_out_a_file_is_refused(tmp_path, name):
    from ccq_eval.harness.archive import archive_results
    from ccq_eval.harness.store import vouch

    unit = _write(tmp_path)
    archive_results(tmp_path / "out", tmp_path / "archive")
    record_path = tmp_path / "archive" / unit.path.relative_to(tmp_path / "out") / vouch.CHECKSUMS_FILE
    record = json.loads(record_path.read_text())
    del record["files"][name]
    record_path.write_text(json.dumps(record))
    with pytest.raises(store.ResultsError) as error:
        store.load_results(tmp_path / "archive")
    assert f"{record_path} leaves out {name}" in str(error.value) and "\n" not in str(error.value)


def test_a_format_4_record_must_name_meta_results_unit_json_and_each_task_s_samples(tmp_path):
    from ccq_eval.harness.store import vouch

    unit = _write(tmp_path)
    results = json.loads(unit.results.read_text())
    assert vouch.required_files(unit.results, results) == [store.META_FILE, store.RESULTS_FILE, "samples_t.jsonl",
                                                           store.UNIT_SPEC_FILE]
    unit.spec.unlink()  # meta.json's "spec" holds the same settings: a unit may lack unit.json
    assert store.UNIT_SPEC_FILE not in vouch.required_files(unit.results, results)
