"""The shipped autotune winners are copied into triton's cache without overwriting anything, and a cache
that cannot be written costs a warning, not the run."""

import io
import json
import tarfile

from ccq_eval.model.kernels import autotune


def _bundle(path, entries: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as bundle:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))


def test_shipped_winners_seed_the_cache_without_overwriting(tmp_path, monkeypatch):
    winner = json.dumps({"key": [64], "configs_timings": []}).encode()
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    _bundle(tuned / "h200-tritonX-flaY.tgz", {
        "tmp/triton-cache/ABC123/chunk_kernel.autotune.json": winner,
        "tmp/triton-cache/DEF456/other_kernel.autotune.json": winner,
        "tmp/triton-cache/DEF456/kernel.cubin": b"binary",  # not a winner: ignored
        "../../escape/evil.autotune.json": winner,  # the key folder must be a plain hash
    })
    _bundle(tuned / "a100-tritonX-flaY.tgz", {"tmp/triton-cache/GHI789/k.autotune.json": winner})
    monkeypatch.setattr(autotune, "TUNED_DIR", tuned)
    cache = tmp_path / "cache"
    (cache / "DEF456").mkdir(parents=True)
    (cache / "DEF456" / "other_kernel.autotune.json").write_text("mine")
    assert autotune.seed_tuned_winners(cache) == 2
    assert (cache / "ABC123" / "chunk_kernel.autotune.json").read_bytes() == winner
    assert (cache / "DEF456" / "other_kernel.autotune.json").read_text() == "mine"  # never overwritten
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) == [
        "ABC123/chunk_kernel.autotune.json", "DEF456/other_kernel.autotune.json", "GHI789/k.autotune.json"]
    assert not (tmp_path / "escape").exists()
    assert autotune.seed_tuned_winners(cache) == 0  # idempotent


def test_a_read_only_cache_only_warns(monkeypatch, caplog):
    """On CUDA prepare_runtime seeds the cache once; a cache it cannot write costs a warning, not the run."""
    import torch

    from ccq_eval.model import modeling_ccq

    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise PermissionError("read-only file system")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(autotune, "seed_tuned_winners", refuse)
    monkeypatch.setattr(modeling_ccq, "_winners_seeded", False)
    with caplog.at_level("WARNING", logger="ccq_eval.model.modeling_ccq"):
        modeling_ccq.prepare_runtime()
        modeling_ccq.prepare_runtime()
    assert calls == [1] and "read-only file system" in caplog.text


def test_the_shipped_winners_are_triton_autotune_records_that_seed_an_empty_cache(tmp_path):
    """Each shipped archive holds only <hash>/<kernel>.autotune.json files in triton's format (the tuning key
    and every candidate's timings); seeding an empty cache writes each of them once."""
    archives = sorted(autotune.TUNED_DIR.glob("*.tgz"))
    assert archives, "no autotune winners in ccq_eval/model/kernels/tuned/"
    expected = set()
    for archive in archives:
        with tarfile.open(archive, "r:gz") as bundle:
            for member in bundle.getmembers():
                key, name = member.name.split("/")
                assert key.isalnum() and name.endswith(".autotune.json"), member.name
                record = json.loads(bundle.extractfile(member).read())
                assert record["key"] and record["configs_timings"], member.name
                expected.add(member.name)
    assert autotune.seed_tuned_winners(tmp_path) == len(expected)
    assert {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()} == expected
