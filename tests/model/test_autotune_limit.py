"""triton's autotuning candidates of fla's kernels are capped inside ccq-eval's scope
(CCQ_EVAL_AUTOTUNE_CONFIGS, default 4, "all": no cap) and left as they were outside it, and the shipped
autotune winners are copied into triton's cache without overwriting anything."""

import io
import json
import tarfile

import pytest
import triton

from ccq_eval.model.kernels import autotune


def _configs():
    return [triton.Config({"BK": bk}, num_warps=w, num_stages=s)
            for bk in (32, 64) for w in (1, 2, 4, 8) for s in (2, 3, 4)]


def test_pick_prefers_middle_warps_and_stages_and_spreads_block_sizes():
    picked = autotune.pick_configs(_configs(), 4)
    assert len(picked) == 4
    assert all(c.num_warps in (4, 8) and c.num_stages in (2, 3) for c in picked)
    assert {c.kwargs["BK"] for c in picked} == {32, 64}
    assert autotune.pick_configs(_configs()[:3], 4) == _configs()[:3]


def test_bad_values_are_refused_and_the_default_is_four(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "zero")
    with pytest.raises(ValueError, match=autotune.ENV_VAR):
        autotune.configured_limit()
    monkeypatch.setenv(autotune.ENV_VAR, "all")
    assert autotune.configured_limit() is None
    monkeypatch.delenv(autotune.ENV_VAR)
    assert autotune.configured_limit() == autotune.DEFAULT_LIMIT == 4


def _many_candidates():
    """A loaded fla autotuner with more candidates than the default cap."""
    import fla.ops.gla.chunk  # noqa: F401  (loads fla's GLA kernels)

    tuners = [t for t in autotune.fla_autotuners() if len(t.configs) > autotune.DEFAULT_LIMIT]
    assert tuners, "no fla autotuner with more than DEFAULT_LIMIT candidates"
    return tuners


def test_the_cap_holds_inside_the_scope_and_is_gone_after_it(monkeypatch):
    monkeypatch.delenv(autotune.ENV_VAR, raising=False)
    tuners = _many_candidates()
    tuner = tuners[0]
    tuner.nargs = {}
    own_tables = [t.cache for t in tuners]
    full = tuner.prune_configs({})
    assert len(full) == len(tuner.configs)  # triton's own pruning outside the scope
    with autotune.capped_autotuning():
        assert len(tuner.prune_configs({})) == autotune.DEFAULT_LIMIT
        assert tuner.prune_configs({}) == autotune.pick_configs(full, autotune.DEFAULT_LIMIT)
        capped_table = tuner.cache
        assert capped_table is not own_tables[0]  # winners under the cap are kept apart
        with autotune.capped_autotuning():  # reentrant: the inner scope changes nothing
            assert tuner.cache is capped_table
        assert tuner.cache is capped_table and "prune_configs" in vars(tuner)
        capped_table[("probe",)] = "a winner under the cap"
    assert all("prune_configs" not in vars(t) for t in tuners)
    assert all(t.cache is table for t, table in zip(tuners, own_tables, strict=True))
    assert ("probe",) not in tuner.cache and len(tuner.prune_configs({})) == len(tuner.configs)
    with autotune.capped_autotuning():
        assert tuner.cache is capped_table  # the next scope finds the winners tuned under the cap
    capped_table.pop(("probe",))


def test_the_scope_is_undone_when_the_run_fails_and_all_means_no_cap(monkeypatch):
    monkeypatch.delenv(autotune.ENV_VAR, raising=False)
    tuners = _many_candidates()
    own_tables = [t.cache for t in tuners]
    with pytest.raises(RuntimeError, match="boom"), autotune.capped_autotuning():
        raise RuntimeError("boom")
    assert all("prune_configs" not in vars(t) and t.cache is table for t, table in zip(tuners, own_tables, strict=True))
    monkeypatch.setenv(autotune.ENV_VAR, "all")
    with autotune.capped_autotuning():
        assert all("prune_configs" not in vars(t) and t.cache is table
                   for t, table in zip(tuners, own_tables, strict=True))


def test_ccq_evals_own_kernels_are_not_capped():
    from ccq_eval.model.kernels import ccq_forward

    tuners = autotune.fla_autotuners()
    assert all(t is not ccq_forward._ccq_read_kernel and t is not getattr(ccq_forward._ccq_read_kernel, "fn", None)
               for t in tuners)


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
    _bundle(tuned / "h200-tritonX-flaY-cap4.tgz", {
        "tmp/triton-cache/ABC123/chunk_kernel.autotune.json": winner,
        "tmp/triton-cache/DEF456/other_kernel.autotune.json": winner,
        "tmp/triton-cache/DEF456/kernel.cubin": b"binary",  # not a winner: ignored
        "../../escape/evil.autotune.json": winner,  # the key folder must be a plain hash
    })
    _bundle(tuned / "h200-tritonX-flaY-cap1.tgz", {"tmp/triton-cache/GHI789/k.autotune.json": winner})
    monkeypatch.setattr(autotune, "TUNED_DIR", tuned)
    monkeypatch.delenv(autotune.ENV_VAR, raising=False)
    cache = tmp_path / "cache"
    (cache / "DEF456").mkdir(parents=True)
    (cache / "DEF456" / "other_kernel.autotune.json").write_text("mine")
    assert autotune.seed_tuned_winners(cache) == 1
    assert (cache / "ABC123" / "chunk_kernel.autotune.json").read_bytes() == winner
    assert (cache / "DEF456" / "other_kernel.autotune.json").read_text() == "mine"  # never overwritten
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) == [
        "ABC123/chunk_kernel.autotune.json", "DEF456/other_kernel.autotune.json"]
    assert not (tmp_path / "escape").exists()
    assert autotune.seed_tuned_winners(cache) == 0  # idempotent
    monkeypatch.setenv(autotune.ENV_VAR, "all")  # another cap: the winners would never match a lookup
    assert autotune.seed_tuned_winners(tmp_path / "other") == 0 and not (tmp_path / "other").exists()


def test_the_package_ships_winners_for_the_default_cap():
    archives = sorted(autotune.TUNED_DIR.glob(f"*-cap{autotune.DEFAULT_LIMIT}.tgz"))
    assert archives, "no autotune winners in ccq_eval/model/kernels/tuned/"
    with tarfile.open(archives[0], "r:gz") as bundle:
        names = [m.name for m in bundle.getmembers() if m.name.endswith(".autotune.json")]
    assert len(names) > 100


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
