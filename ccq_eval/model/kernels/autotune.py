"""Autotune winners shipped for the GPUs they were measured on, copied into triton's own cache.

fla's kernels autotune over up to 48 configurations each (block sizes x warps x stages), and triton
compiles and times every candidate the first time a kernel meets a new tuning key: on a fresh machine the
GLA / Gated DeltaNet kernel set takes many minutes before the first result. ccq-eval leaves that tuning to
triton and fla as they are (no candidate is removed); it only saves the first run on a known GPU from
repeating it.

Triton stores each autotuned kernel's winner in its cache directory (fla passes cache_results=True, unless
FLA_CACHE_RESULTS=0), keyed by the triton version, the GPU's backend, the kernel's source, the tuning key
and the candidate list. `seed_tuned_winners` copies the winners shipped in tuned/ into that directory
without overwriting anything: where the key matches (the same GPU, triton and fla, the same model shapes),
no candidate but the winner compiles; elsewhere the files are never looked up and triton tunes as usual.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

TUNED_DIR = Path(__file__).with_name("tuned")  # <gpu>-triton<version>-fla<version>.tgz


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
    members other than such JSON files are ignored, and nothing is written outside cache_dir."""
    cache_dir = Path(cache_dir) if cache_dir is not None else triton_cache_dir()
    added = 0
    for archive in sorted(TUNED_DIR.glob("*.tgz")):
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
