"""Torch versions of fla's ops for the mamba2 layers (fla 0.6).

OPS: fla op name -> FlaOp (merged into dispatch.OPS; a layer whose code looks the name up gets the
dispatcher bound in its place). MODULE_FORWARDS: "fla.module.path:Class" -> (torch forward, name of the
tensor argument that decides the device) (merged into the backend's module table).
"""

from __future__ import annotations

from collections.abc import Callable

from ccq_eval.model.fla_cpu.common import FlaOp

OPS: dict[str, FlaOp] = {}
MODULE_FORWARDS: dict[str, tuple[Callable, str]] = {}
