"""Progress of a long step (a model converted or loaded) as log lines a person can follow.

A first start spends minutes converting GGUF files and loading models inside library
calls (transformers) that take no callback. A `ProgressReport` names the step and its
size, then logs a line when its phase changes, when the phase's measured part passes
another tenth (a line a second at most), and at least every few seconds; its last line
says how long it took.

What is measured is what a second thread can watch while the library works: the tqdm
bars that transformers opens over its tensor loops (`library_bar`), or a count the caller
offers (bytes written so far). Phases with neither (a GGUF file's metadata parsed) are
named, with the seconds they have taken, but given no percentage.

Each record carries a `progress` field (in `extra["fields"]`, which the services' JSON
logs write out): the launcher finds them in its workers' logs (`progress_messages`) and
shows them on its console.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PROGRESS_FIELD = "progress"  # the JSON log field that marks a progress record
POLL_S = 0.5  # how often the watching thread looks: a few looks per tenth of a 30 s phase
EVERY_S = 5.0  # the most seconds between lines, so that a phase with no measure shows it lives
TENTH = 0.1  # a line each time a measured phase passes another tenth,
MIN_GAP_S = 1.0  # but not closer than this: a phase of a few seconds says so in a few lines


@dataclass(frozen=True)
class Observed:
    """How far the work watched has come."""

    fraction: float  # of it done, 0 to 1
    detail: str  # what was counted, e.g. "109 of 272" (tensors) or "260 MB of 517 MB"
    label: str = ""  # what the work calls itself (a bar's title); "" = the phase's name


Measure = Callable[[], "Observed | None"]  # None: nothing to measure at this moment


def human_bytes(count: int) -> str:
    """93 MB, 1.1 GB: two or three figures, in units of 1024 as `ls -h` and the docs count."""
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if count >= size:
            value = count / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{count} B"


def library_bar() -> Observed | None:
    """The newest tqdm bar open in this process, read without redrawing it: transformers
    shows its loops over tensors with them and offers no other way to follow them (its
    legacy GGUF loop takes no hook). A worker loads one model at a time, so it is that one's."""
    try:
        from tqdm import tqdm
    except ImportError:  # no tqdm, no bars: phases go without a percentage
        return None
    try:  # the set changes while a bar opens or closes in the loading thread: look next time
        # a bar is in the set before its __init__ has set total: read as not yet open
        bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if getattr(bar, "total", None)]
    except RuntimeError:
        return None
    if not bars:
        return None
    bar = max(bars, key=lambda b: getattr(b, "start_t", 0.0))
    label = str(bar.desc or "").rstrip(".: ")
    label = label[:1].lower() + label[1:]
    return Observed(min(1.0, bar.n / bar.total), f"{bar.n} of {bar.total}", label)


def log_progress(log: logging.Logger, text: str) -> None:
    """One progress record: an INFO line the launcher shows on its console."""
    log.info(text, extra={"fields": {PROGRESS_FIELD: True}})


class ProgressReport:
    """The lines of one long step, from a thread that watches it.

        with ProgressReport("converting x.gguf (93 MB)", log) as report:
            report.phase("reading the tokenizer")
            ...
            report.finish(f"converted x.gguf in {report.elapsed_s:.1f} s")

    quiet_s: no line before the step has taken this long (a quick load logs only its end).
    """

    def __init__(self, subject: str, log: logging.Logger, quiet_s: float = 0.0):
        self.subject = subject
        self.log = log
        self.quiet_s = quiet_s
        self.started = time.monotonic()
        self._lock = threading.Lock()  # phase() from the working thread, looks from the watcher
        self._phase, self._measure = "starting", None
        self._label, self._tenth, self._line_at = "", -1, float("-inf")
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="progress", daemon=True)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def __enter__(self) -> ProgressReport:
        self._watcher.start()
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self._stop_watching()
        if error_type is not None:
            log_progress(self.log, f"{self.subject}: failed after {self.elapsed_s:.0f} s")

    def phase(self, name: str, measure: Measure | None = library_bar) -> None:
        """Starts a phase: lines name it, with measure's fraction while it has one."""
        with self._lock:
            self._phase, self._measure, self._label = name, measure, ""
        self.look()

    def finish(self, text: str) -> None:
        """The last line (say what was done and in how long: `elapsed_s`)."""
        self._stop_watching()
        log_progress(self.log, text)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self.look()

    def _stop_watching(self) -> None:
        self._stop.set()
        if self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join()

    def look(self) -> None:
        """Logs a line if one is due: a new phase or label, another tenth, or EVERY_S."""
        with self._lock:
            observed = self._measure() if self._measure else None
            label = (observed.label if observed else "") or self._phase
            tenth = int(observed.fraction / TENTH + 1e-9) if observed else -1
            now = time.monotonic()
            # A bar that closes hands back to the phase's name: no line for that alone.
            new_label = label != self._label and (observed is not None or not self._label)
            if new_label or observed is None:
                self._tenth = -1
            further = tenth > self._tenth and now - self._line_at >= MIN_GAP_S
            due = new_label or further or now - self._line_at >= EVERY_S
            self._label = label
            if not due or self.elapsed_s < self.quiet_s:
                return
            self._line_at, self._tenth = now, max(self._tenth, tenth)
        log_progress(self.log, self._line(label, observed))

    def _line(self, label: str, observed: Observed | None) -> str:
        measured = f" {observed.fraction:.0%} ({observed.detail})" if observed else ""
        return f"{self.subject}: {label}{measured}, {self.elapsed_s:.0f} s"


def progress_messages(text: str) -> Iterator[str]:
    """The messages of the progress records in text, a piece of a JSON log (whole lines).
    A record may follow a tqdm bar's redraw on its line (both write to stderr, the bar
    with no newline), so each line is read from its first '{"'."""
    for line in text.splitlines():
        start = line.find('{"')
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(record, dict) and record.get(PROGRESS_FIELD):
            yield str(record.get("message", ""))
