"""triton's autotuning candidates are capped (CCQ_EVAL_AUTOTUNE_CONFIGS, default 4, "all": no cap), and
the shipped autotune winners are copied into triton's cache without overwriting anything."""

import io
import json
import tarfile

import pytest
import triton
from triton.runtime.autotuner import Autotuner

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


def test_env_var_wraps_prune_configs_and_bad_values_are_refused(monkeypatch):
    # triton's own method, whether or not an earlier prepare_runtime() in this process wrapped it
    original = getattr(Autotuner.prune_configs, "_ccq_original", Autotuner.prune_configs)
    monkeypatch.setattr(Autotuner, "prune_configs", Autotuner.prune_configs)  # restored after the test
    monkeypatch.setenv(autotune.ENV_VAR, "2")
    autotune.install_limit_from_env()
    tuner = Autotuner.__new__(Autotuner)
    tuner.configs, tuner.early_config_prune, tuner.perf_model, tuner.configs_top_k = _configs(), None, None, 1.0
    assert len(Autotuner.prune_configs(tuner, {})) == 2
    from ccq_eval.model.kernels import ccq_forward

    tuner.fn = ccq_forward._ccq_read_kernel.fn  # ccq-eval's own kernels keep their candidates
    assert len(Autotuner.prune_configs(tuner, {})) == len(_configs())
    autotune.install_limit_from_env()  # idempotent: wraps the original, not the wrapper
    assert Autotuner.prune_configs._ccq_original is original
    monkeypatch.setenv(autotune.ENV_VAR, "zero")
    with pytest.raises(ValueError, match=autotune.ENV_VAR):
        autotune.configured_limit()
    monkeypatch.delenv(autotune.ENV_VAR)
    assert autotune.configured_limit() == autotune.DEFAULT_LIMIT == 4
    autotune.install_limit_from_env()
    assert len(Autotuner.prune_configs(_tuner(), {})) == 4  # the default cap
    monkeypatch.setenv(autotune.ENV_VAR, "all")
    assert autotune.configured_limit() is None
    autotune.install_limit_from_env()  # every candidate: triton's own prune_configs again
    assert Autotuner.prune_configs is original


def _tuner():
    tuner = Autotuner.__new__(Autotuner)
    tuner.configs, tuner.early_config_prune, tuner.perf_model, tuner.configs_top_k = _configs(), None, None, 1.0
    return tuner


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
    monkeypatch.setattr(Autotuner, "prune_configs", Autotuner.prune_configs)  # restored after the test
    with caplog.at_level("WARNING", logger="ccq_eval.model.modeling_ccq"):
        modeling_ccq.prepare_runtime()
        modeling_ccq.prepare_runtime()
    assert calls == [1] and "read-only file system" in caplog.text
