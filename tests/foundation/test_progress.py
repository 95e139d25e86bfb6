"""Progress of long starts: a model converted or loaded says how far it has come.

A report logs a line per tenth of a measured phase, not per step, and reads the tqdm
bars transformers opens over its tensors; a real conversion of a tiny GGUF file (the
`python -m model_runtime.model_cache` command, then a load) logs lines with the file's
size, a percentage and the time taken; the launcher shows what a worker process logs of
its progress, read from the worker's JSON log as it grows, tqdm's redraws and other
records left out. The real SmolLM2 file (slow): its de-quantized tensors counted.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from foundation import progress
from foundation.progress import Observed, ProgressReport, human_bytes, progress_messages
from launcher.cluster import ProgressEcho
from model_runtime.loading import load_model, resolve_model_source
from tests.tiny_gguf import write_tiny_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)
SIZE = r"\d+(\.\d)? (B|kB|MB|GB)"


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    (tmp_path / "models").mkdir()
    return write_tiny_gguf(tmp_path / "models" / "tiny.gguf")


def _progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "fields", {}).get("progress")]


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "SPECULATIVE_MODEL_CACHE": str(cache), "PYTHONPATH": str(REPO_ROOT)}


def test_a_measured_phase_logs_a_line_per_tenth_not_per_step(caplog, monkeypatch):
    monkeypatch.setattr(progress, "POLL_S", 60.0)  # this test looks itself, step by step,
    monkeypatch.setattr(progress, "MIN_GAP_S", 0.0)  # faster than a person reads
    caplog.set_level(logging.INFO)
    done = [0]
    with ProgressReport(f"converting x.gguf ({human_bytes(98_000_000)})", log) as report:
        report.phase("de-quantizing", measure=lambda: Observed(done[0] / 100, f"{done[0]} of 100"))
        for done[0] in range(1, 101):
            report.look()
        report.finish(f"converted x.gguf in {report.elapsed_s:.1f} s")
    lines = _progress_lines(caplog)
    percents = [int(m.group(1)) for m in map(re.compile(r" (\d+)% \(").search, lines) if m]
    assert percents == list(range(0, 101, 10))
    assert all(line.startswith("converting x.gguf (93 MB): de-quantizing") for line in lines[:-1])
    assert re.fullmatch(r"converted x\.gguf in \d+\.\d s", lines[-1])


def test_a_phase_with_no_measure_still_logs_every_few_seconds_and_a_failure_says_so(
    caplog, monkeypatch
):
    monkeypatch.setattr(progress, "POLL_S", 60.0)
    caplog.set_level(logging.INFO)
    with pytest.raises(OSError), ProgressReport("loading m (1.0 GB, float32)", log) as report:
        report.phase("reading its config", measure=None)
        report.look()  # not due yet
        monkeypatch.setattr(progress, "EVERY_S", 0.0)
        report.look()
        raise OSError("disk full")
    assert _progress_lines(caplog) == [
        "loading m (1.0 GB, float32): reading its config, 0 s",
        "loading m (1.0 GB, float32): reading its config, 0 s",
        "loading m (1.0 GB, float32): failed after 0 s",
    ]


def test_a_tqdm_bar_open_in_the_process_is_read(monkeypatch):
    with tqdm(
        total=272, desc="Converting and de-quantizing GGUF tensors...", file=io.StringIO()
    ) as bar:
        bar.update(68)
        assert progress.library_bar() == Observed(
            0.25, "68 of 272", "converting and de-quantizing GGUF tensors"
        )
    assert progress.library_bar() is None  # closed


def test_a_tqdm_bar_still_being_built_is_not_read():
    class HalfBuilt:  # in tqdm's set, its __init__ not yet past setting total
        pass

    half_built = HalfBuilt()
    tqdm._instances.add(half_built)
    try:
        assert progress.library_bar() is None
    finally:
        tqdm._instances.discard(half_built)


def test_the_convert_command_logs_sizes_percentages_and_its_time(tmp_path, tiny_gguf):
    done = subprocess.run(
        [sys.executable, "-m", "model_runtime.model_cache", str(tiny_gguf)],
        env=_env(tmp_path / "cache"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in re.split(r"[\r\n]", done.stderr) if "tiny.gguf" in line]
    subject = rf"converting tiny\.gguf \({SIZE}\)"
    assert re.fullmatch(rf"{subject} into the model cache as float32: once, .*", lines[0])
    assert any(
        re.fullmatch(rf"{subject}: writing safetensors \d+% \({SIZE} of {SIZE}\), \d+ s", line)
        for line in lines
    )
    assert any(
        re.fullmatch(rf"converted tiny\.gguf \({SIZE}\) to float32 in \d+\.\d s", line)
        for line in lines
    )


def test_a_first_load_reports_the_conversion_then_the_load(
    tmp_path, tiny_gguf, caplog, monkeypatch
):
    monkeypatch.setenv("SPECULATIVE_MODEL_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO)
    load_model(str(tiny_gguf), pack_cpu_linears=False)
    first = _progress_lines(caplog)
    assert "converting tiny.gguf" in first[0]
    assert re.fullmatch(rf"loaded .*tiny\.gguf \({SIZE}, float32\) in \d+\.\d s", first[-1])
    caplog.clear()
    load_model(str(tiny_gguf), pack_cpu_linears=False)  # from the cache: quick, its last line only
    assert len(_progress_lines(caplog)) == 1


def test_progress_records_are_found_after_a_tqdm_redraw_on_their_line():
    record = {"time": "t", "level": "info", "message": "loaded m in 1.0 s", "progress": True}
    other = {"time": "t", "level": "info", "message": "serving"}
    text = (
        f"\rLoading weights:  40%|####  | 109/272{json.dumps(record)}\n"
        f"{json.dumps(other)}\n\rWriting model shards: 100%|##########| 1/1\n"
    )
    assert list(progress_messages(text)) == ["loaded m in 1.0 s"]


# A worker as the launcher starts one: JSON logs on stderr, into its log file.
WORKER = (
    "import sys; from pathlib import Path; from service_common.logs import configure_logging; "
    "from model_runtime.model_cache import ensure_converted; configure_logging('target'); "
    "ensure_converted(Path(sys.argv[1]), 'float32')"
)


def test_the_launcher_shows_what_a_worker_logs_of_its_progress(tmp_path, tiny_gguf):
    log_file, console = tmp_path / "target-0.log", io.StringIO()
    with log_file.open("w") as worker_log:
        echo = ProgressEcho(console)
        echo.follow("target-0", log_file)
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tiny_gguf)],
            env=_env(tmp_path / "cache"),
            cwd=REPO_ROOT,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
        )
        while worker.poll() is None:  # as the launcher does while it waits for health
            echo.echo()
            time.sleep(0.1)
        echo.echo()
    assert worker.returncode == 0, log_file.read_text()[-2000:]
    shown = console.getvalue().splitlines()
    assert shown[0].startswith("  target-0: converting tiny.gguf (")
    assert re.fullmatch(
        rf"  target-0: converted tiny\.gguf \({SIZE}\) to float32 in \d+\.\d s", shown[-1]
    )
    assert any(re.search(r"\d+% \(", line) for line in shown)
    assert not [line for line in shown if "model cache entry" in line or "%|" in line]


@pytest.mark.slow
def test_smollm2s_tensors_are_counted_as_they_are_de_quantized(tmp_path):
    source = resolve_model_source("smollm2-135m")
    done = subprocess.run(
        [sys.executable, "-m", "model_runtime.model_cache", "smollm2-135m"],
        env=_env(tmp_path / "cache"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    subject = rf"converting {re.escape(source.gguf_file)} \(94 MB\)"
    tensors = rf"{subject}: converting and de-quantizing GGUF tensors \d+% \(\d+ of 272\), \d+ s"
    assert any(re.fullmatch(tensors, line) for line in re.split(r"[\r\n]", done.stderr))
