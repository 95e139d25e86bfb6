"""The served model's tokenizer as GetTokenizer serves it: what an orchestrator needs to
turn text into token ids and back without a model file of its own."""

from __future__ import annotations

import gzip

from model_runtime.loading import LoadedModel
from service_common.status import FailedPrecondition
from specdec.v1 import target_pb2


def served_tokenizer(loaded: LoadedModel) -> target_pb2.GetTokenizerResponse:
    """The model's tokenizer as GetTokenizer serves it (orchestrator/tokenizer.py rebuilds it)."""
    tokenizer = loaded.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise FailedPrecondition(
            f"model {loaded.name!r} has no tokenizer of the tokenizers library to serve: "
            "start the orchestrator with --tokenizer"
        )
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the one transformers uses by default
        template = template.get("default")
    return target_pb2.GetTokenizerResponse(
        # mtime=0: the same tokenizer gives the same bytes on every worker.
        tokenizer_json_gzip=gzip.compress(backend.to_str().encode(), compresslevel=6, mtime=0),
        chat_template=template or "",
        special_tokens={name: str(token) for name, token in tokenizer.special_tokens_map.items()},
        clean_up_tokenization_spaces=_cleans_up_spaces(tokenizer, backend),
        fingerprint=loaded.fingerprint,
        model_id=loaded.name,
    )


def _cleans_up_spaces(tokenizer, backend) -> bool:
    """Whether transformers' decode removes spaces before punctuation for this tokenizer:
    its setting, which transformers ignores for BPE models unless told it really means it."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    return type(backend.model).__name__ != "BPE" or bool(forced)
