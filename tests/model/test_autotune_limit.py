"""CCQ_EVAL_AUTOTUNE_CONFIGS caps triton's autotuning candidates; unset, nothing changes."""

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
    original = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs", original)  # restored after the test
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
    assert autotune.configured_limit() is None
