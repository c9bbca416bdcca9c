"""A cap on the candidates of fla's triton autotuners for the GPU tests (tests/conftest.py), so that a fresh
GPU machine runs the suite in minutes: without it triton compiles and times every candidate of every fla
kernel (up to 48 each) for each new tuning key. ccq-eval itself leaves fla's autotuning as it is; which
candidate wins changes a kernel's speed, and its results only by float rounding
(tests/model/test_ccq_triton.py checks every candidate of ccq-eval's own kernels against fp64).

Inside `capped_autotuning()` each fla autotuner keeps at most LIMIT candidates (those with 4 or 8 warps and
2 or 3 stages first, spread over the block sizes) and a winner table of its own; on exit both are taken
away again, so that tests outside the scope see fla as it was.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator

LIMIT = 4


def pick_configs(configs: list, limit: int) -> list:
    """At most `limit` of `configs`, preferring 4-8 warps and 2-3 stages, evenly spread over the rest."""
    if len(configs) <= limit:
        return configs
    preferred = [c for c in configs if c.num_warps in (4, 8) and c.num_stages in (2, 3)] or configs
    if len(preferred) <= limit:
        return preferred
    step = len(preferred) / limit
    return [preferred[int(i * step)] for i in range(limit)]


def fla_autotuners() -> list:
    """Every triton autotuner of the fla modules loaded now (module attributes and the kernels they wrap)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no triton: no fla kernel can run
        return []

    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "fla" or module_name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # heuristics -> autotune -> jit: a few wrappers at most
                if isinstance(value, Autotuner):
                    found[id(value)] = value
                value = getattr(value, "fn", None)
                if value is None:
                    break
    return list(found.values())


_scope_lock = threading.Lock()
_scope_depth = 0
_scoped: list[tuple] = []  # (autotuner, its own winner table) while the scope is open
_capped_winners: dict[tuple[int, int], dict] = {}  # (id(autotuner), cap) -> winners under that cap


@contextlib.contextmanager
def capped_autotuning(limit: int = LIMIT) -> Iterator[None]:
    """Within this scope fla's autotuners keep at most `limit` candidates and their own table of winners; on
    exit every autotuner has triton's prune_configs and its own winners back. Reentrant (an inner scope
    inside an outer one changes nothing)."""
    global _scope_depth
    with _scope_lock:
        _scope_depth += 1
        if _scope_depth == 1:
            for tuner in fla_autotuners():
                _scoped.append((tuner, tuner.cache))
                tuner.cache = _capped_winners.setdefault((id(tuner), limit), {})
                tuner.prune_configs = functools.partial(_capped_prune, tuner, limit)
    try:
        yield
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0:
                for tuner, own_winners in _scoped:
                    tuner.cache = own_winners
                    vars(tuner).pop("prune_configs", None)
                _scoped.clear()


def _capped_prune(tuner, limit: int, kwargs: dict) -> list:
    """triton's pruning of `tuner`'s candidates, then at most `limit` of them (pick_configs)."""
    return pick_configs(type(tuner).prune_configs(tuner, kwargs), limit)
