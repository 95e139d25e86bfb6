"""Tokenizer fingerprints: a draft may only serve a target with the same vocabulary.

Speculative decoding compares token ids, so draft and target must map text to ids the
same way (llama.cpp's `common_speculative_are_compatible` makes the same check). The
fingerprint hashes the full token -> id map and the special tokens; embedding sizes may
differ (models pad their vocabularies), the tokenizers may not.
"""

from __future__ import annotations

import hashlib
import json

from foundation.errors import IncompatibleModels

# A drafter that needs no vocabulary (n-gram lookup) is compatible with every target.
ANY_VOCABULARY = "any"


def tokenizer_fingerprint(tokenizer) -> str:
    """A short stable hash of the vocabulary and special tokens of a HF tokenizer."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")
    }
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_compatible(target_name: str, target_fp: str, draft_name: str, draft_fp: str) -> None:
    """Raises IncompatibleModels with both names and fingerprints if they differ."""
    if ANY_VOCABULARY in (target_fp, draft_fp) or target_fp == draft_fp:
        return
    raise IncompatibleModels(
        f"draft {draft_name!r} (tokenizer {draft_fp}) cannot serve target {target_name!r} "
        f"(tokenizer {target_fp}): speculative decoding needs draft and target to share one "
        "vocabulary; choose a draft from the target's model family"
    )
