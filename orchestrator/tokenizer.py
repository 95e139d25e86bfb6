"""The target's tokenizer, fetched from a target worker at first use.

The orchestrator needs no model file and no torch: a target serves its tokenizer
(TargetService.GetTokenizer: tokenizer.json, chat template, special tokens), rebuilt
here with the tokenizers library, and chat templates render with transformers' Jinja
rules (chat_template.py). The orchestrator may start before any target worker
(Kubernetes starts pods in any order, the launcher starts every role at once): until a
target answers, calls get UNAVAILABLE rather than the orchestrator refusing to start.

--tokenizer overrides the target's: a tokenizer.json file, a directory holding one with
its tokenizer_config.json (a saved Hugging Face tokenizer, a model cache entry), or a
model name, which the core loads (that one imports transformers).
"""

from __future__ import annotations

import gc
import gzip
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from model_runtime.fingerprint import tokenizer_fingerprint
from orchestrator.chat_template import render_chat_template
from orchestrator.workers import WorkerPool
from service_common.server import freeze_startup_heap
from service_common.status import FailedPrecondition, Unavailable
from specdec.v1 import target_pb2

log = logging.getLogger(__name__)

# The named special tokens of transformers' tokenizers (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TargetTokenizer:
    def __init__(self, pool: WorkerPool, name: str = "", tokenizer=None, timeout_s: float = 30.0):
        self.pool, self.name, self.timeout_s = pool, name, timeout_s
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def get(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = (
                    load_tokenizer_override(self.name) if self.name else self._from_target()
                )
                # It lives as long as the process, like what start-up built: where that
                # was frozen out of the collector's reach, so is this (else the next
                # calls pay full collections of 30-100 ms, walking what loading it left).
                if gc.get_freeze_count():
                    freeze_startup_heap()
            return self._tokenizer

    def fetch_ahead(self, period_s: float) -> None:
        """Fetches the tokenizer in the background as soon as a target serves, so that
        the first call does not wait for it (half a second for SmolLM2's)."""

        def fetch() -> None:
            while True:
                try:
                    self.get()
                    return
                except Exception as error:  # noqa: BLE001 - no target yet: a call gets the error
                    log.debug("tokenizer not fetched yet: %s", error)
                if self._stop.wait(period_s):
                    return

        threading.Thread(target=fetch, name="tokenizer-fetch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _from_target(self) -> ServedTokenizer:
        targets = self.pool.live_targets()
        if not targets:
            raise Unavailable(
                self.pool.why_empty(
                    "no target worker is reachable to learn the tokenizer from; "
                    "start a target worker or set --tokenizer"
                )
            )
        target = targets[0]
        try:
            served = target.stub.GetTokenizer(
                target_pb2.GetTokenizerRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as error:
            raise Unavailable(
                f"cannot fetch the tokenizer from target {target.worker_id} at {target.address} "
                f"({error.code().name}: {error.details()}); set --tokenizer to load one here"
            ) from None
        return ServedTokenizer.from_served(served)


@dataclass
class Encoding:
    input_ids: list[int]


class ServedTokenizer:
    """A tokenizer of the tokenizers library with what the orchestrator asks of it
    (text <-> ids, the chat template, the special tokens' ids), answering as transformers'
    tokenizer built from the same tokenizer.json answers."""

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str = "",
        special_tokens: Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ):
        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        # As transformers encodes a single text: no truncation, no padding, special
        # tokens written in the text are matched as special tokens.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._tokenizer.encode_special_tokens = False
        self.chat_template = chat_template or None
        self.special_tokens_map = {k: v for k, v in (special_tokens or {}).items() if v}
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces

    @classmethod
    def from_served(cls, served: target_pb2.GetTokenizerResponse) -> ServedTokenizer:
        """From a target's GetTokenizer; FailedPrecondition unless it rebuilds to the
        fingerprint the target announced (the draft pairing relies on that hash)."""
        tokenizer = cls(
            gzip.decompress(served.tokenizer_json_gzip).decode(),
            served.chat_template,
            dict(served.special_tokens),
            served.clean_up_tokenization_spaces,
        )
        if served.fingerprint and tokenizer.fingerprint != served.fingerprint:
            raise FailedPrecondition(
                f"the tokenizer target {served.model_id!r} served hashes to {tokenizer.fingerprint} here, not to its "
                f"fingerprint {served.fingerprint}: set --tokenizer"
            )
        return tokenizer

    @classmethod
    def from_directory(cls, directory: Path) -> ServedTokenizer:
        """A tokenizer saved by transformers (tokenizer.json, tokenizer_config.json and
        maybe chat_template.jinja, special_tokens_map.json)."""
        config = _read_json(directory / "tokenizer_config.json")
        special = {**_read_json(directory / "special_tokens_map.json"), **config}
        special_tokens = {
            name: _token_text(special[name]) for name in SPECIAL_TOKEN_NAMES if special.get(name)
        }
        template_file = directory / "chat_template.jinja"
        template = (
            template_file.read_text()
            if template_file.is_file()
            else config.get("chat_template") or ""
        )
        if isinstance(template, list):  # named templates: the one transformers uses by default
            template = next((t["template"] for t in template if t.get("name") == "default"), "")
        tokenizer = cls((directory / "tokenizer.json").read_text(), template, special_tokens)
        tokenizer.clean_up_tokenization_spaces = bool(
            config.get("clean_up_tokenization_spaces")
        ) and (
            tokenizer._model_kind != "BPE"
            or bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
                )
            )
        )
        return tokenizer

    # The special tokens' ids, as transformers' <name>_token_id.

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
    ):
        """The prompt's token ids (tokenize) or text; return_dict is not offered."""
        if return_dict:
            raise NotImplementedError("return_dict: the orchestrator reads token ids only")
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        text = render_chat_template(
            self.chat_template, messages, self.special_tokens_map, add_generation_prompt
        )
        # The template writes the special tokens itself (as transformers tokenizes it).
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @property
    def _model_kind(self) -> str:
        return json.loads(self._tokenizer.to_str())["model"]["type"]

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        if token is None:
            return None
        found = self._tokenizer.token_to_id(token)
        # transformers maps a token outside the vocabulary to the unknown token's id.
        return found if found is not None or name == "unk_token" else self.unk_token_id


def load_tokenizer_override(name: str):
    """--tokenizer: a tokenizer.json, a directory with one, or a model name."""
    path = Path(name)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return ServedTokenizer.from_directory(path)
    if path.is_file() and path.suffix == ".json":
        return ServedTokenizer(path.read_text())
    from model_runtime.loading import load_tokenizer  # imports transformers: only for this override

    return load_tokenizer(name)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    return token["content"] if isinstance(token, dict) else str(token)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of decoded text: no space before punctuation and contractions."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
