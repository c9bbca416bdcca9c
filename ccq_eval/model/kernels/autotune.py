"""Optional cap on triton autotuning, for short GPU leases.

fla's kernels autotune over up to 48 configurations each (block sizes x warps x stages), and triton
compiles every candidate: on a fresh machine the GLA / Gated DeltaNet kernel set takes about 20 minutes
before the first result. CCQ_EVAL_AUTOTUNE_CONFIGS=N keeps at most N candidates per kernel (those with
4 or 8 warps and 2 or 3 stages first, spread over the block sizes); ccq-eval's own kernels, which list
a few chosen candidates, keep them all. Unset (the default) changes nothing.
Kernels are then tuned over fewer choices, so timings taken with the cap may be slower than fully tuned
ones: benchmark reports record the setting. Triton caches the winners on disk (fla passes
cache_results=True), so a later process with the same cap and TRITON_CACHE_DIR compiles one config each.
"""

from __future__ import annotations

import os

ENV_VAR = "CCQ_EVAL_AUTOTUNE_CONFIGS"


def configured_limit() -> int | None:
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{ENV_VAR} must be a positive integer (configs per kernel), got {text!r}")
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


def install_limit_from_env() -> None:
    """Wrap triton's Autotuner.prune_configs when the environment asks for a cap (idempotent)."""
    limit = configured_limit()
    if limit is None:
        return
    from triton.runtime.autotuner import Autotuner

    original = getattr(Autotuner.prune_configs, "_ccq_original", Autotuner.prune_configs)

    def prune_configs(self, *args, **kwargs):
        configs = original(self, *args, **kwargs)
        if getattr(getattr(self, "fn", None), "__module__", "").startswith("ccq_eval."):
            return configs  # ccq-eval's own kernels list a few candidates each on purpose
        return pick_configs(configs, limit)

    prune_configs._ccq_original = original
    Autotuner.prune_configs = prune_configs
