"""How the workers of one results folder split its units with --shard K/N: the first worker records N and
the units it splits (<output>/.shards.json); a worker that would split them otherwise is refused, since
K/N takes every N-th unit of the plan's order, and workers with different N (or different grids) leave
units that none of them runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from ccq_eval.atomic_io import atomic_write_json
from ccq_eval.harness.options import PlanError
from ccq_eval.harness.plan import RunPlan

SHARDS_FILE = ".shards.json"


def claim_split(plan: RunPlan) -> None:
    """Record this worker's split of `plan`'s units, or raise PlanError naming the record and the fix when
    another worker split the folder's units otherwise and some of them are not finished yet. Without
    --shard nothing is read or written (workers without it share units through their locks)."""
    options = plan.options
    if options.shard is None:
        return
    count = int(options.shard.split("/")[1])
    units = [str(unit.dir.path.relative_to(plan.store.output)) for unit in plan.units]
    import filelock

    output = Path(plan.store.output)
    output.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(output / ".shards.lock")):  # workers starting together read and write in turn
        path = output / SHARDS_FILE
        try:
            recorded = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, ValueError):
            recorded = None  # unreadable: rewritten below
        if isinstance(recorded, dict) and (recorded.get("count"), recorded.get("units")) != (count, units):
            unfinished = [name for name in recorded.get("units") or []
                          if isinstance(name, str) and not (output / name / "results.json").is_file()]
            if unfinished:
                other = ("the same N but another grid of units (other --model / --task / --suite)"
                         if recorded.get("count") == count else f"N = {recorded.get('count')}")
                raise PlanError(
                    f"--shard {options.shard}: another worker into {output} split its units with {other} "
                    f"({path}), and {len(unfinished)} of them are not finished; K/N takes every N-th unit, so "
                    "workers that split differently leave units none of them runs: give every worker the same "
                    "command with its own K, or wait until they finish, or use another --output")
        atomic_write_json(path, {"count": count, "units": units})
