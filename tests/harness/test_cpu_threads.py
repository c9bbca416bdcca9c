"""The CPU thread count `ccq-eval run` gives torch."""

from __future__ import annotations

import os

from ccq_eval.harness import runner


def test_user_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert runner.cpu_threads() == 3


def test_default_is_half_the_usable_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert runner.cpu_threads() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert runner.cpu_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")  # ignored, as torch ignores it
    assert runner.cpu_threads() == 1
