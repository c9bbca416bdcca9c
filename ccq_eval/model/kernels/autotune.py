"""A cap on triton autotuning while ccq-eval runs, and autotune winners shipped for the GPUs they were
measured on.

fla's kernels autotune over up to 48 configurations each (block sizes x warps x stages), and triton
compiles every candidate: on a fresh machine the full GLA / Gated DeltaNet kernel set takes about 20
minutes before the first result. So a user's first run does not wait that long, inside
`capped_autotuning()` (the lm-eval adapter's calls, the inspection, training and benchmark scripts)
fla's kernels keep at most DEFAULT_LIMIT candidates each (those with 4 or 8 warps and 2 or 3 stages
first, spread over the block sizes); CCQ_EVAL_AUTOTUNE_CONFIGS=N keeps N, and
CCQ_EVAL_AUTOTUNE_CONFIGS=all every candidate. ccq-eval's own kernels, which list a few chosen
candidates, keep them all. The project's GPU benchmarks were measured with the default cap; fully
tuned kernels may be faster.

The cap is a scope, not a patch: on entry each fla autotuner gets a capped `prune_configs` of its own
and a winner table of its own (the winners found under the cap), and on exit both are taken away
again. Outside the scope, in the same process, a plain fla model tunes over all of triton's
candidates and keeps its own winners, as it would without ccq-eval.

Triton stores each autotuned kernel's winner in its cache directory (fla passes cache_results=True),
keyed by the triton version, the GPU's backend, the kernel's source, the tuning key and the candidate
list. `seed_tuned_winners` copies the winners shipped in tuned/ (measured under the default cap) into
that directory without overwriting anything: where the key matches (the same GPU, triton and fla),
only the winning candidate compiles; elsewhere the files are never looked up.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

ENV_VAR = "CCQ_EVAL_AUTOTUNE_CONFIGS"
DEFAULT_LIMIT = 4
TUNED_DIR = Path(__file__).with_name("tuned")  # <gpu>-triton<version>-fla<version>-cap<N>.tgz


def configured_limit() -> int | None:
    """Candidates per fla kernel: CCQ_EVAL_AUTOTUNE_CONFIGS (a positive integer, or "all": None, no
    cap), DEFAULT_LIMIT when it is unset."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return DEFAULT_LIMIT
    if text.lower() == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{ENV_VAR} must be a positive integer (configs per kernel) or 'all', got {text!r}")
    return int(text)


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
def capped_autotuning() -> Iterator[None]:
    """Within this scope fla's autotuners keep at most configured_limit() candidates and their own table of
    winners; on exit every autotuner has triton's prune_configs and its own winners back. Reentrant (an
    inner scope inside an outer one changes nothing); with CCQ_EVAL_AUTOTUNE_CONFIGS=all it does nothing."""
    global _scope_depth
    limit = configured_limit()
    if limit is None:
        yield
        return
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


def triton_cache_dir() -> Path:
    """Where triton keeps its cache: TRITON_CACHE_DIR, else triton's own default."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # older triton
        return Path.home() / ".triton" / "cache"


def seed_tuned_winners(cache_dir: Path | None = None) -> int:
    """Copy the shipped autotune winners (tuned/*.tgz: <hash>/<kernel>.autotune.json entries) into
    triton's cache directory, never overwriting a file there; returns how many were added. Archive
    members other than such JSON files are ignored, and nothing is written outside cache_dir. Only
    under the default cap do the shipped winners match a lookup, so another cap skips the copy."""
    if configured_limit() != DEFAULT_LIMIT:
        return 0
    cache_dir = Path(cache_dir) if cache_dir is not None else triton_cache_dir()
    added = 0
    for archive in sorted(TUNED_DIR.glob(f"*-cap{DEFAULT_LIMIT}.tgz")):
        with tarfile.open(archive, "r:gz") as bundle:
            for member in bundle.getmembers():
                parts = Path(member.name).parts
                if (not member.isfile() or len(parts) < 2 or not parts[-1].endswith(".autotune.json")
                        or ".." in parts or Path(member.name).is_absolute()):
                    continue
                key, name = parts[-2], parts[-1]
                if not key.isalnum():
                    continue
                target = cache_dir / key / name
                if target.exists():
                    continue
                data = bundle.extractfile(member).read()
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f"{name}.{os.getpid()}.tmp")
                partial.write_bytes(data)
                os.replace(partial, target)  # a concurrent reader sees the whole file or none
                added += 1
    return added
