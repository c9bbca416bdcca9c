"""Checkpoint folders without loading them: a light check of their files and their identity.

Used when a run is planned (before torch is imported) and by the loader: a folder without
config.json, with only pickle weights, or with a truncated or foreign safetensors file is refused
with a message naming the file and the fix. The fingerprint hashes every file that decides what the
model computes (config, weights, tokenizer) whole; a large file's hash is remembered by its size,
times and inode, so an unchanged multi-GB checkpoint is read once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from ccq_eval.atomic_io import atomic_write_json
from ccq_eval.errors import UserError

SAFE_WEIGHT_PATTERNS = ("*.safetensors",)
PICKLE_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Files whose bytes decide what a checkpoint computes (README, training logs and the like do not).
FINGERPRINT_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                        "*.bin", "*.bin.index.json", "tokenizer*", "special_tokens_map.json", "vocab*",
                        "merges.txt", "*.model", "*.tiktoken")
_HASH_BLOCK = 8 << 20
_CACHE_MIN_BYTES = 64 << 20  # smaller files hash faster than the cache is read


class CheckpointError(UserError, ValueError):
    """A checkpoint folder that cannot be used; the message names the file and what to do."""


def pickle_only_message(folder: Path) -> str:
    return (f"{folder} has only pickle weights (pytorch_model.bin), which can run code when loaded: convert "
            "them to model.safetensors (load the model in Python and call model.save_pretrained(folder)), "
            "or, in Python, load_model(..., allow_pickle=True) if you trust their source")


def check_safetensors(path: Path) -> None:
    """A safetensors file must be whole: its header parses and its tensors end where the file ends."""
    fix = "re-download or re-save the checkpoint (model.save_pretrained(folder))"
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is not a safetensors file ({size} bytes, no header): {fix}")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path} is not a safetensors file (bad header length): {fix}")
            header = json.loads(handle.read(header_size))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON): {fix}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object): {fix}")
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + header_size + max(ends, default=0)
    if expected != size:
        state = "truncated" if size < expected else "longer than its header says"
        raise CheckpointError(f"{path} is {state} ({size} bytes, its header says {expected}): {fix}")


def check_checkpoint_folder(folder: Path) -> None:
    """config.json and safetensors weights that are whole; pickle-only weights are refused."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} is not a checkpoint folder (no config.json): pass a folder with "
                              "config.json and model.safetensors, e.g. one written by save_pretrained")
    weights = sorted(p for pattern in SAFE_WEIGHT_PATTERNS for p in folder.glob(pattern))
    if not weights:
        if any((folder / name).exists() for name in PICKLE_WEIGHT_FILES):
            raise CheckpointError(pickle_only_message(folder))
        raise CheckpointError(f"{folder} has no weights (no *.safetensors file): save the model with "
                              "model.save_pretrained(folder)")
    for path in weights:
        check_safetensors(path)


def fingerprint(folder: Path) -> dict[str, Any]:
    """{"sha256": {file name: digest}} of the files that decide what the checkpoint computes."""
    folder = Path(folder)
    files = sorted({p for pattern in FINGERPRINT_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    return {"sha256": {p.name: file_sha256(p) for p in files}}


def _hash_cache_file() -> Path:
    base = os.environ.get("CCQ_EVAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ccq-eval")
    return Path(base) / "file_sha256.json"


def file_sha256(path: Path) -> str:
    """sha256 of the whole file, read in 8 MiB blocks. Files of 64 MiB or more are remembered by
    path, size, mtime, ctime and inode (a write changes ctime, which no tool can set back)."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"
    cached: dict[str, str] = {}
    cache_file = _hash_cache_file()
    if stat.st_size >= _CACHE_MIN_BYTES:
        try:
            cached = json.loads(cache_file.read_text(encoding="utf-8"))
            if key in cached:
                return cached[key]
        except (OSError, ValueError, AttributeError):
            cached = {}
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    value = digest.hexdigest()
    if stat.st_size >= _CACHE_MIN_BYTES:
        prefix = f"{path.resolve()}|"
        cached = {k: v for k, v in cached.items() if not k.startswith(prefix)} | {key: value}
        with contextlib.suppress(OSError):  # best effort: a read-only home only costs the next run a re-hash
            atomic_write_json(cache_file, cached)
    return value
