"""What a host measures, it measures once: kernel choices and pass timings kept across starts.

A worker times things that depend on the machine and its software, not on the request:
which invariant kernel and block each linear shape runs fastest with
(row_invariance.py), what a pass of each width costs (width_padding.py). Measuring them
at every start cost a warm restart of the Qwen2.5-Coder-1.5B target 13 s of its 37 s.
They are kept in one JSON file per cache directory, under a key that covers everything
that changes a kernel's code path or speed: the CPU model and its instruction-set flags,
the torch, MKL and oneDNN builds, and the intra-op threads. Another host, an upgraded
torch or another thread count finds no entry and measures again.

The file: SPECULATIVE_KERNEL_CACHE, else `host_measurements.json` beside the model cache.
Writes replace the file whole (a temporary file renamed), so a reader never sees half of
one; two workers writing at once may lose one's entry, which is then measured again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform

import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bumped when what an entry means changes: older entries are ignored
FILE_NAME = "host_measurements.json"


def cache_path() -> str:
    from model_runtime.model_cache import cache_root

    return os.environ.get("SPECULATIVE_KERNEL_CACHE") or str(cache_root() / FILE_NAME)


def host_key() -> str:
    """This host and its software, as far as kernels depend on them (see module doc)."""
    return f"{_host_software()}|threads {torch.get_num_threads()}"


@functools.cache
def _host_software() -> str:
    cpu, flags = _cpu_model_and_flags()
    build = hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:12]
    return (
        f"v{FORMAT_VERSION}|{cpu}|flags {hashlib.sha256(flags.encode()).hexdigest()[:12]}|"
        f"torch {torch.__version__} build {build}"
    )


def _cpu_model_and_flags() -> tuple[str, str]:
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def lookup(kind: str, key: str) -> dict | None:
    """The entry measured for `kind` ("linear", "widths") and `key` on this host, if any."""
    return _load().get(f"{host_key()}|{kind}|{key}")


def remember(kind: str, key: str, entry: dict) -> None:
    cache = _load()
    cache[f"{host_key()}|{kind}|{key}"] = entry
    _save(cache)


def _load() -> dict:
    try:
        with open(cache_path()) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {}


def _save(cache: dict) -> None:
    path = cache_path()
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(temporary, "w") as file:
            json.dump(cache, file, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:  # a read-only cache: measured again next start
        log.warning("cannot keep host measurements at %s: %s", path, error)
