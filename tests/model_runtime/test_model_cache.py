"""model_runtime.model_cache: a GGUF model converted once into the cache, mapped afterwards.

On a tiny Llama written as a GGUF file (tests/tiny_gguf.py), each test with a cache
directory of its own: the converted weights, tokenizer and chat template equal what
transformers loads from the GGUF file, exactly; a second load parses no GGUF; entries
are keyed by content, dtype and transformers version; concurrent first loads, failed
conversions and unwritable caches leave no broken entry. The real SmolLM2 file: slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from model_runtime import model_cache
from model_runtime.fingerprint import tokenizer_fingerprint
from model_runtime.loading import load_model, load_tokenizer, resolve_model_source
from tests.conftest import PROMPTS
from tests.tiny_gguf import write_tiny_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECULATIVE_MODEL_CACHE", str(root))
    return root


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    (tmp_path / "models").mkdir()
    return write_tiny_gguf(tmp_path / "models" / "tiny.gguf")


def _from_gguf(path: Path, dtype=torch.float32):
    """What transformers itself loads from the GGUF file: the reference."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _entries(cache: Path) -> list[Path]:
    return sorted(
        p for p in (cache / model_cache.CONVERTED_DIR).iterdir() if not p.name.startswith(".")
    )


def _assert_same_model(loaded, reference_model, reference_tokenizer) -> None:
    expected, actual = reference_model.state_dict(), loaded.model.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name
    tokenizer = loaded.tokenizer
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(reference_tokenizer)
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    for text in [*PROMPTS, "héllo wörld ✓ 日本"]:
        ids = reference_tokenizer(text).input_ids
        assert tokenizer(text).input_ids == ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference_tokenizer.decode(
            ids, skip_special_tokens=True
        )
    assert tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    ) == reference_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_the_converted_form_equals_what_transformers_loads_from_the_gguf_file(cache, tiny_gguf):
    loaded = load_model(str(tiny_gguf), pack_cpu_linears=False)
    (entry,) = _entries(cache)
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in entry.iterdir()
    }
    source = json.loads((entry / model_cache.SOURCE_FILE).read_text())
    assert (source["sha256"], source["dtype"]) == (model_cache.content_hash(tiny_gguf), "float32")
    reference_model, reference_tokenizer = _from_gguf(tiny_gguf)
    _assert_same_model(loaded, reference_model, reference_tokenizer)
    ids = torch.tensor([loaded.tokenizer("The quick brown fox").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference_model(ids).logits)
    assert (loaded.vocab_size, loaded.context_length) == (257, 1024)


def test_a_second_load_reads_the_cache_and_parses_no_gguf(cache, tiny_gguf, monkeypatch):
    first = load_model(str(tiny_gguf), pack_cpu_linears=False)

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", no_parsing)
    monkeypatch.setattr(model_cache, "convert_gguf", no_parsing)
    second = load_model(str(tiny_gguf), pack_cpu_linears=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values())
    )
    # the tokenizer alone too
    assert load_tokenizer(str(tiny_gguf)).get_vocab() == first.tokenizer.get_vocab()
    assert len(_entries(cache)) == 1


def test_a_served_dtype_is_converted_and_stored_in_that_dtype(cache, tiny_gguf):
    loaded = load_model(str(tiny_gguf), dtype="bfloat16", pack_cpu_linears=False)
    reference_model, reference_tokenizer = _from_gguf(tiny_gguf, dtype=torch.bfloat16)
    _assert_same_model(loaded, reference_model, reference_tokenizer)
    (entry,) = _entries(cache)
    assert "-bfloat16-" in entry.name


def test_entries_are_keyed_by_content_dtype_and_transformers_version(cache, tiny_gguf, monkeypatch):
    first = model_cache.ensure_converted(tiny_gguf, "float32")
    assert model_cache.ensure_converted(tiny_gguf, "float32") == first
    assert model_cache.ensure_converted(tiny_gguf, "bfloat16") != first
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    assert "transformers99.0.0" in model_cache.ensure_converted(tiny_gguf, "float32").name
    monkeypatch.undo()
    monkeypatch.setenv("SPECULATIVE_MODEL_CACHE", str(cache))
    write_tiny_gguf(tiny_gguf, seed=5)  # the same path, other weights: another entry
    changed = model_cache.ensure_converted(tiny_gguf, "float32")
    assert changed != first
    assert len(_entries(cache)) == 4
    reloaded = load_model(str(tiny_gguf), pack_cpu_linears=False)
    assert torch.equal(reloaded.model.lm_head.weight, _from_gguf(tiny_gguf)[0].lm_head.weight)


def test_the_content_hash_is_remembered_until_the_file_changes(cache, tiny_gguf, monkeypatch):
    digest = model_cache.content_hash(tiny_gguf)
    (memo,) = (cache / model_cache.HASHES_DIR).iterdir()
    remembered = json.loads(memo.read_text())
    memo.write_text(json.dumps({**remembered, "sha256": "remembered"}))
    assert model_cache.content_hash(tiny_gguf) == "remembered"  # not read again
    os.utime(tiny_gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert model_cache.content_hash(tiny_gguf) == digest  # touched: read again


def test_two_first_loads_at_once_convert_once_and_both_load_it(cache, tiny_gguf):
    """Two worker processes on one host start with an empty cache."""
    script = (
        "import logging, sys; from model_runtime.loading import load_model; logging.basicConfig(level='INFO'); "
        "m = load_model(sys.argv[1], pack_cpu_linears=False); "
        "print(float(sum(p.double().sum() for p in m.model.parameters())))"
    )
    env = {**os.environ, "SPECULATIVE_MODEL_CACHE": str(cache), "PYTHONPATH": str(REPO_ROOT)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tiny_gguf)],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [err[-2000:] for _, err in results]
    assert len({out for out, _ in results}) == 1
    converting = [err for _, err in results if "into the model cache" in err]
    assert len(converting) == 1, "the second process waited for the first one's conversion"
    (entry,) = _entries(cache)
    assert not [
        p for p in (cache / model_cache.CONVERTED_DIR).glob(".*") if not p.name.endswith(".lock")
    ]
    reference_model, reference_tokenizer = _from_gguf(tiny_gguf)
    _assert_same_model(
        load_model(str(tiny_gguf), pack_cpu_linears=False), reference_model, reference_tokenizer
    )


def test_writers_without_the_lock_race_to_one_whole_entry(cache, tiny_gguf, monkeypatch):
    """Hosts sharing a cache volume whose file system ignores flock: both convert, the
    first rename wins, the other writer maps the winner's entry and drops its copy."""
    monkeypatch.setattr(model_cache.fcntl, "flock", lambda *args: None)
    both_converting = threading.Barrier(2)

    def slow_convert(gguf_path, dtype, out):
        (out / "model.safetensors").write_bytes(b"half")
        both_converting.wait(timeout=10)
        (out / "model.safetensors").write_bytes(b"whole")

    monkeypatch.setattr(model_cache, "convert_gguf", slow_convert)
    entries = []
    threads = [
        threading.Thread(
            target=lambda: entries.append(model_cache.ensure_converted(tiny_gguf, "float32"))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(entries) == 2 and entries[0] == entries[1] == _entries(cache)[0]
    assert (entries[0] / "model.safetensors").read_bytes() == b"whole"
    assert not list((cache / model_cache.CONVERTED_DIR).glob("*.partial"))


def test_a_failed_conversion_leaves_no_entry(cache, tiny_gguf, monkeypatch):
    def failing(gguf_path, dtype, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(model_cache, "convert_gguf", failing)
    with pytest.raises(RuntimeError):
        model_cache.ensure_converted(tiny_gguf, "float32")
    assert not [
        p for p in (cache / model_cache.CONVERTED_DIR).iterdir() if not p.name.endswith(".lock")
    ]
    monkeypatch.undo()
    monkeypatch.setenv("SPECULATIVE_MODEL_CACHE", str(cache))
    assert model_cache.ensure_converted(tiny_gguf, "float32").is_dir()


def test_an_unwritable_cache_loads_the_gguf_file_itself(tmp_path, tiny_gguf, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECULATIVE_MODEL_CACHE", str(blocker / "cache"))  # cannot be created
    assert model_cache.ensure_converted(tiny_gguf, "float32") is None
    loaded = load_model(str(tiny_gguf), pack_cpu_linears=False)
    assert torch.equal(loaded.model.lm_head.weight, _from_gguf(tiny_gguf)[0].lm_head.weight)


def test_entries_are_readable_by_every_user(cache, tiny_gguf):
    """An image converts as root at build time; the service runs as another user."""
    entry = model_cache.ensure_converted(tiny_gguf, "float32")
    for path in [entry, *entry.rglob("*")]:
        assert path.stat().st_mode & 0o004, path


def test_the_command_fills_the_cache_ahead_of_time(tmp_path, tiny_gguf, capsys):
    assert model_cache.main([str(tiny_gguf), "--cache-dir", str(tmp_path / "built")]) == 0
    entry = Path(capsys.readouterr().out.strip())
    assert entry.parent == tmp_path / "built" / model_cache.CONVERTED_DIR and entry.is_dir()
    assert model_cache.main(["tiny-random"]) == 0  # not a GGUF model: nothing to do
    assert model_cache.main([str(tmp_path / "missing.gguf")]) == 2


@pytest.mark.slow
def test_smollm2_converted_equals_smollm2_from_its_gguf_file(cache):
    source = resolve_model_source("smollm2-135m")
    path = Path(source.path) / source.gguf_file
    reference_model, reference_tokenizer = _from_gguf(path)
    _assert_same_model(
        load_model("smollm2-135m", pack_cpu_linears=False), reference_model, reference_tokenizer
    )
