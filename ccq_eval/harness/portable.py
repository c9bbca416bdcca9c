"""Paths of one machine out of the files an archive commits.

A run records where it ran: the working folder, the model folder, the output folder in its command line,
lm-eval's task YAML path, a tokenizer folder in each document. An archive is meant to be committed and
read on other machines, so it names those places relative to the run's working folder (a checkout's
`models/tiny-gdn`, `tasks/s_niah/ccq_s_niah_1.yaml`) and the run's output folder by the archive's own
path. Only whole path components are rewritten, and only under those two roots; numbers and hashes are
never touched, so an archived unit reads exactly as the run it came from.

    rewrite = PathRewrite.for_unit(meta, source=Path("/tmp/run"), destination=Path("results/ruler"))
    rewrite(meta)  # {"cwd": ".", "model_source": "models/tiny-gdn", "command_line": "... -o results/ruler"}
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PathRewrite:
    """Absolute roots and what each becomes, longest root first (a root inside another wins)."""

    roots: tuple[tuple[str, str], ...]

    @classmethod
    def for_unit(cls, meta: dict[str, Any], source: Path, destination: Path) -> PathRewrite:
        """The rewrite of one unit's files: the run's output folder `source` becomes the archive's folder
        (relative to the run's working folder when it lies inside it), the working folder itself '.'."""
        cwd = meta.get("cwd") if isinstance(meta.get("cwd"), str) and os.path.isabs(meta["cwd"]) else None
        destination = destination.resolve()
        shown = str(destination)
        if cwd is not None and destination.is_relative_to(cwd):
            shown = str(destination.relative_to(cwd)) or "."
        roots = {str(source.resolve()): shown}
        if cwd is not None and cwd != "/":
            roots.setdefault(cwd.rstrip("/"), ".")
        return cls(tuple(sorted(roots.items(), key=lambda item: len(item[0]), reverse=True)))

    def text(self, value: str) -> str:
        for root, replacement in self.roots:
            if root in value:
                # the root as a whole path: followed by a separator, the end, or a quote / space / comma;
                # "ROOT/x" with ROOT -> "." reads "x"
                pattern = re.compile(re.escape(root) + r"(/|(?=$|[\s'\",;:)\]]))")
                value = pattern.sub(lambda m, r=replacement: "" if r == "." and m.group(1) else r + m.group(1),
                                    value)
        return value

    def __call__(self, value: Any) -> Any:
        """`value` (JSON-like) with every string rewritten."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self(item) for item in value]
        return value
