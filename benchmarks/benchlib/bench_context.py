"""The Bench context every section takes: settings, the models it builds once, the tokenizer, the
matmul ceiling, and the rows and errors collected.

Every case runs inside Bench.attempt: a failure (out of memory, an unsupported combination) is
recorded under "errors" with its case, and the other cases still run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchlib import workload
from benchlib.timing import matmul_rate


class Bench:
    """Settings, shared state (models, tokenizer, the matmul ceiling) and collected results."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings
        self.device = torch.device(settings["device"])
        self.dtype = settings["dtype"]
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.errors: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self._models: dict[str, torch.nn.Module] = {}
        self.tokenizer, self.tokenizer_spec = workload.load_tokenizer(settings["tokenizer"])
        self.vocab_size = settings.get("vocab_size") or len(self.tokenizer)
        self.matmul: dict[str, Any] | None = None
        self.on_update: Callable[[], Any] | None = None  # called after every recorded row / error

    # -------------------------------------------------------------------------------- helpers
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def log(self, message: str) -> None:
        print(f"[bench {time.perf_counter() - self.started:7.1f}s] {message}", file=sys.stderr, flush=True)

    def model(self, arch: str) -> torch.nn.Module:
        if arch not in self._models:
            self.log(
                f"building {arch} ({'smoke' if self.settings['smoke'] else '340M'} shape, "
                f"vocab {self.vocab_size}, {self.dtype}) on {self.device}"
            )
            model = workload.build_model(
                arch, self.settings["shapes"][arch], self.vocab_size, self.device, self.dtype
            )
            self._models[arch] = model
        return self._models[arch]

    def model_info(self) -> dict[str, Any]:
        return {
            arch: {"parameters": workload.parameter_count(m), "config": self.settings["shapes"][arch]}
            for arch, m in self._models.items()
        }

    def stock_hflm(self, model: torch.nn.Module, max_length: int) -> Any:
        """lm-eval's stock HFLM over `model` (this run's tokenizer and device, batch size 1): what the
        harness and sniah sections compare the ccq adapter with."""
        from lm_eval.models.huggingface import HFLM

        return HFLM(
            pretrained=model,
            tokenizer=self.tokenizer,
            backend="causal",
            max_length=max_length,
            batch_size=1,
            device=str(self.device),
        )

    def attempt(self, section: str, case: dict[str, Any], fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as error:  # noqa: BLE001  (record and carry on with the other cases)
            message = f"{type(error).__name__}: {error}"
            self.log(f"{section} {case}: FAILED {message[:300]}")
            self.errors.append({"section": section, "case": case, "error": message[:2000]})
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._updated()
            return None

    def add(self, section: str, row: dict[str, Any]) -> dict[str, Any]:
        self.results.setdefault(section, []).append(row)
        self._updated()
        return row

    def _updated(self) -> None:
        if self.on_update is not None:
            self.on_update()

    def ccq_settings(self, arch: str | None = None) -> list[bool]:
        """The CCQ settings to run: --ccq's, or CCQ off alone for fla's own families (no CCQ layers)."""
        if arch in workload.FLA_ARCHS:
            return [False]
        return [flag == "on" for flag in self.settings["ccq"]]

    def matmul_ceiling(self) -> dict[str, Any]:
        if self.matmul is None:
            size = self.settings["matmul_size"]
            self.log(f"measuring the {self.dtype} matmul rate ({size}^3)")
            self.matmul = matmul_rate(self.device, self.dtype, size)
            self.log(f"matmul: {self.matmul['flops_per_s'] / 1e12:.2f} TFLOP/s")
        return self.matmul
