"""Convert once, map many times: the ready form of a GGUF model in the model cache.

transformers reads a GGUF file three times per load (config, tokenizer, weights),
walking its metadata through numpy slices and de-quantizing every tensor: 30-50 s for
the 93 MB SmolLM2-135M on a CPU. The first load of a GGUF file writes what that produced
to the cache directory: the weights as safetensors in the dtype that is served, the
config, `tokenizer.json` with the tokenizer's settings and chat template. Later loads
read that directory the way they read any Hugging Face checkpoint (the weights
memory-mapped), with no GGUF parsing.

An entry is named by the source file's content hash (SHA-256), the transformers version
(its GGUF conversion may change) and the dtype, so a changed file, an upgraded
transformers or another dtype gets an entry of its own and a stale one is never read.
An entry is written into a temporary directory and renamed into place, under a lock:
a reader sees a whole entry or none, and of two processes loading the same model for the
first time one converts while the other waits, then maps the result.

The cache directory: SPECULATIVE_MODEL_CACHE, else $XDG_CACHE_HOME/speculative-serving,
else ~/.cache/speculative-serving. `python -m model_runtime.model_cache MODEL` fills it
ahead of time (the container image does so at build time).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from foundation.progress import Measure, Observed, ProgressReport, human_bytes, log_progress

log = logging.getLogger(__name__)

# Bumped whenever what an entry holds, or how it is written, changes.
FORMAT_VERSION = 1
CONVERTED_DIR = "converted"
HASHES_DIR = "hashes"
SOURCE_FILE = "source.json"  # in each entry: what it was made from, for people
HASH_BLOCK_BYTES = 8 * 1024 * 1024


def cache_root() -> Path:
    configured = os.environ.get("SPECULATIVE_MODEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "speculative-serving"


def content_hash(path: Path) -> str:
    """SHA-256 of the file's content (hex). Remembered in the cache by path, size and
    modification time, so a large file is read once, not at every start (the inode is
    left out: an image's layers copy files with their times but not their inodes)."""
    path = path.resolve()
    stat = path.stat()
    identity = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    memo = (
        cache_root() / HASHES_DIR / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    )
    with contextlib.suppress(OSError, ValueError):
        remembered = json.loads(memo.read_text())
        if remembered.get("identity") == identity:
            return remembered["sha256"]
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(HASH_BLOCK_BYTES):
            digest.update(block)
    sha256 = digest.hexdigest()
    try:
        _write_atomically(memo, json.dumps({"identity": identity, "sha256": sha256}))
    except OSError as error:  # a read-only cache: hashing again next time is correct, only slower
        log.debug("cannot remember the hash of %s: %s", path, error)
    return sha256


def entry_name(source_sha256: str, dtype: str) -> str:
    import transformers

    return f"{source_sha256[:32]}-{dtype}-transformers{transformers.__version__}-v{FORMAT_VERSION}"


def find_entry(gguf_path: Path, dtype: str | None = None) -> Path | None:
    """The ready form of gguf_path in dtype (any dtype when None), if the cache has one."""
    sha256 = content_hash(gguf_path)
    converted = cache_root() / CONVERTED_DIR
    if dtype is not None:
        entry = converted / entry_name(sha256, dtype)
        return entry if entry.is_dir() else None
    import transformers

    suffix = f"-transformers{transformers.__version__}-v{FORMAT_VERSION}"
    with contextlib.suppress(OSError):
        for entry in sorted(converted.glob(f"{sha256[:32]}-*{suffix}")):
            if entry.is_dir():
                return entry
    return None


def ensure_converted(gguf_path: Path, dtype: str) -> Path | None:
    """The entry of gguf_path in dtype, converted now if the cache has none. None when
    the cache cannot be written (a read-only image, a full disk): the caller then loads
    the GGUF file itself, as slowly as before."""
    sha256 = content_hash(gguf_path)
    converted = cache_root() / CONVERTED_DIR
    entry = converted / entry_name(sha256, dtype)
    if entry.is_dir():
        return entry
    try:
        converted.mkdir(parents=True, exist_ok=True)
        lock = open(converted / f".{entry.name}.lock", "a")  # noqa: SIM115 - held across the conversion
    except OSError as error:
        log.warning(
            "model cache %s is not writable (%s): loading %s without converting it",
            converted,
            error,
            gguf_path,
        )
        return None
    with lock:
        _lock_saying_so(lock, gguf_path)  # released when the file closes, or the process dies
        if entry.is_dir():  # another process converted it while this one waited
            return entry
        start, partial = time.perf_counter(), None
        try:
            partial = Path(
                tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".partial", dir=converted)
            )
            convert_gguf(gguf_path, dtype, partial)
            _write_atomically(
                partial / SOURCE_FILE,
                json.dumps(
                    {
                        "source": str(gguf_path.resolve()),
                        "sha256": sha256,
                        "dtype": dtype,
                        "format_version": FORMAT_VERSION,
                        "converted_s": round(time.perf_counter() - start, 2),
                    },
                    indent=1,
                ),
            )
            _readable_by_all(partial)
            os.rename(partial, entry)
        except OSError as error:
            if entry.is_dir():  # a writer that took no lock (another host on a shared volume) won
                return entry
            log.warning(
                "cannot write %s into the model cache (%s): loading it without converting",
                gguf_path,
                error,
            )
            return None
        finally:
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
    log.info("model cache entry of %s: %s", gguf_path.name, entry)
    return entry


def _lock_saying_so(lock, gguf_path: Path) -> None:
    """Takes the entry's lock; says so when it waits (another process converts the file)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log_progress(log, f"{gguf_path.name}: another process is converting it, waiting for it")
        fcntl.flock(lock, fcntl.LOCK_EX)


def convert_gguf(gguf_path: Path, dtype: str, out: Path) -> None:
    """Loads gguf_path the way transformers does (de-quantized to dtype) and saves the
    result into out as a Hugging Face checkpoint, logging its progress as it goes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, file_name = str(gguf_path.parent), gguf_path.name
    size = human_bytes(gguf_path.stat().st_size)
    subject = f"converting {file_name} ({size})"
    log_progress(log, f"{subject} into the model cache as {dtype}: once, later starts map it")
    with ProgressReport(subject, log) as report:
        report.phase("reading its tokenizer from the GGUF metadata")
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file_name)
        # Parsing the metadata twice more (config, tensor names) shows no bar; de-quantizing does.
        report.phase("reading its config and tensors")
        model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=file_name, dtype=getattr(torch, dtype)
        )
        _as_plain_checkpoint(model)
        report.phase("writing safetensors", measure=_bytes_written(out, _tensor_bytes(model)))
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        report.finish(f"converted {file_name} ({size}) to {dtype} in {report.elapsed_s:.1f} s")


def _as_plain_checkpoint(model) -> None:
    """transformers marks a GGUF-loaded model as quantized, only to de-quantize it while
    loading; the tensors are plain, so the model saves as a plain checkpoint."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]


def _allocated(path: Path) -> int:
    stat = path.stat()
    return min(stat.st_size, stat.st_blocks * 512)  # st_blocks counts 512-byte units


def _tensor_bytes(model) -> int:
    """What the model's tensors take in a checkpoint (a tied weight is stored once)."""
    return sum({t.data_ptr(): t.nbytes for t in model.state_dict().values()}.values())


def _bytes_written(out: Path, expected: int) -> Measure:
    """How much of expected the files in out hold yet. Counted in allocated blocks:
    safetensors sizes its (hidden, temporary) file in full first, then fills it."""

    def measure() -> Observed | None:
        try:
            written = sum(_allocated(path) for path in out.iterdir())
        except OSError:  # a file renamed while listed: look again next time
            return None
        detail = f"{human_bytes(written)} of {human_bytes(expected)}"
        return Observed(min(1.0, written / max(expected, 1)), detail)

    return measure


def _readable_by_all(directory: Path) -> None:
    """An entry is shared: a cache filled as root (an image's build) is read by the
    service's own user (mkdtemp makes the directory private, some writers the files)."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from model_runtime.loading import DTYPES

    parser = argparse.ArgumentParser(
        prog="python -m model_runtime.model_cache",
        description="Convert GGUF models into the model cache ahead of their first load "
        "(e.g. while building an image).",
    )
    parser.add_argument("models", nargs="+", help="packaged model names or .gguf paths")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="the dtype the workers will serve",
    )
    parser.add_argument(
        "--cache-dir",
        default="",
        help="instead of SPECULATIVE_MODEL_CACHE / ~/.cache/speculative-serving",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cache_dir:
        os.environ["SPECULATIVE_MODEL_CACHE"] = args.cache_dir
    # Log lines through tqdm.write: on a terminal they print above transformers' bars, not into them.
    with logging_redirect_tqdm():
        return _convert_all(args.models, args.dtype)


def _convert_all(models: list[str], dtype: str) -> int:
    """Each model converted (its entry's path printed), or the exit status of the first failure."""
    from foundation.errors import SpeculativeError
    from model_runtime.loading import resolve_model_source

    for name in models:
        try:
            source = resolve_model_source(name)
        except SpeculativeError as error:
            print(f"{name}: {error}", file=sys.stderr)
            return 2
        if not source.gguf_file:
            print(
                f"{name}: not a GGUF model; it loads as it is, nothing to convert", file=sys.stderr
            )
            continue
        entry = ensure_converted(Path(source.path) / source.gguf_file, dtype)
        if entry is None:
            return 1
        print(entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
