"""Freed KV-cache memory goes back to the OS, at most once per interval."""

from __future__ import annotations

import sys

import pytest

from target_service.memory import FreedMemory


def test_trims_at_most_once_per_interval():
    now, trims = [0.0], []
    freed = FreedMemory(min_interval_s=5.0, trim=lambda: trims.append(now[0]), clock=lambda: now[0])
    assert freed.returned() and not freed.returned()  # a burst of closes: one trim
    now[0] = 4.9
    assert not freed.returned()
    now[0] = 5.0
    assert freed.returned()
    assert trims == [0.0, 5.0]


def test_without_glibc_nothing_is_trimmed():
    freed = FreedMemory()
    freed._trim = None
    assert not freed.returned()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_glibc_trim_runs_here():
    assert FreedMemory().returned()
