"""The command line: a generation with statistics, and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speculative", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


def test_generates_and_prints_statistics():
    result = _run(
        "abcabcabc",
        "--model",
        "tiny-random",
        "--drafter",
        "ngram",
        "--k",
        "3",
        "--max-new-tokens",
        "12",
    )
    assert result.returncode == 0, result.stderr
    assert "loading tiny-random: done" in result.stderr
    assert "tokens: 12 in" in result.stderr
    assert "acceptance" in result.stderr


def test_model_drafter():
    result = _run(
        "hello",
        "--model",
        "tiny-random:1",
        "--drafter",
        "model:tiny-random:1",
        "--max-new-tokens",
        "8",
    )
    assert result.returncode == 0, result.stderr
    assert "acceptance 100.0%" in result.stderr


def test_bad_input_is_a_clear_error_not_a_traceback():
    result = _run("hi", "--model", "tiny-random", "--temperature", "-1")
    assert result.returncode == 2
    assert "error: temperature must be finite and >= 0" in result.stderr
    assert "Traceback" not in result.stderr
    result = _run("hi", "--model", "no-such-model")
    assert result.returncode == 2 and "unknown model 'no-such-model'" in result.stderr
