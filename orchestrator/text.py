"""Tokens <-> text for the public API: prompts in, text deltas out, stop strings.

Text is decoded from all generated tokens each time (so multi-byte characters split
across tokens come out whole), and the last few characters are held back while they
could still be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from jinja2 import TemplateError

from foundation.errors import InvalidArgument


def render_chat(
    tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True
) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("the target's tokenizer has no chat template: send text or token ids")
    if not messages:
        raise InvalidArgument("prompt is empty: the chat has no messages")
    for message in messages:
        if message["role"] not in ("system", "user", "assistant"):
            raise InvalidArgument(
                f"chat role must be system, user or assistant, got {message['role']!r}"
            )
    try:
        return list(
            tokenizer.apply_chat_template(
                list(messages),
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        )
    except (
        ValueError,
        TemplateError,
    ) as error:  # a template's raise_exception: e.g. roles out of order
        raise InvalidArgument(
            f"the chat messages do not fit the target's chat template: {error}"
        ) from error


class TextAssembler:
    """Generated tokens in; text deltas and the tokens behind them out, cut before the
    first stop string. A token is released only once all its text is final, so the
    tokens a client has seen are always committed ones."""

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.hold_back = max((len(s) for s in self.stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted_chars = 0
        self.emitted_tokens = 0
        self.stopped_at: int | None = None  # character index of the stop string found
        # The text of each token of the last release, concatenating to its text (a
        # character split across tokens goes to the first, text of a token not yet
        # released to the last released one); empty when no token was released.
        self.pieces: list[str] = []

    def add(self, token_ids: Sequence[int]) -> tuple[list[int], str]:
        """Adds tokens; returns the tokens and text now final. Sets stopped_at on a stop."""
        self.token_ids.extend(token_ids)
        text = self._decode(self.token_ids)
        search_from = max(0, self.emitted_chars - self.hold_back)
        hits = [i for i in (text.find(s, search_from) for s in self.stop_strings) if i >= 0]
        if hits:
            self.stopped_at = min(hits)
            return self._release(text, self.stopped_at)
        # An incomplete multi-byte character at the end is no text yet: the characters
        # held back (those that could begin a stop string) are counted before it, since
        # it may complete into the rest of a stop string.
        complete = len(text) - 1 if text.endswith("\ufffd") else len(text)
        return self._release(text, complete - self.hold_back)

    def finish(self) -> tuple[list[int], str]:
        """What is left, at the end of generation (up to the stop string, if one hit)."""
        text = self._decode(self.token_ids)
        return self._release(text, len(text) if self.stopped_at is None else self.stopped_at)

    @property
    def kept_tokens(self) -> list[int]:
        """The generated tokens to commit: all, or those entirely before the stop string."""
        return (
            self.token_ids[: self.emitted_tokens] if self.stopped_at is not None else self.token_ids
        )

    @property
    def text(self) -> str:
        text = self._decode(self.token_ids)
        return text if self.stopped_at is None else text[: self.stopped_at]

    def _release(self, text: str, final: int) -> tuple[list[int], str]:
        count = self.emitted_tokens
        ends = []  # where the text of each released token ends
        while (
            count < len(self.token_ids)
            and (end := len(self._decode(self.token_ids[: count + 1]))) <= final
        ):
            count += 1
            ends.append(end)
        if self.stopped_at is None and final >= len(text):
            ends += [final] * (len(self.token_ids) - count)
            count = len(self.token_ids)
        tokens, self.emitted_tokens = self.token_ids[self.emitted_tokens : count], count
        delta = text[self.emitted_chars : final] if final > self.emitted_chars else ""
        start, self.emitted_chars = self.emitted_chars, max(self.emitted_chars, final)
        self.pieces = []
        for index, end in enumerate(ends):
            stop = (
                self.emitted_chars
                if index == len(ends) - 1
                else min(max(end, start), self.emitted_chars)
            )
            self.pieces.append(text[start:stop])
            start = stop
        return tokens, delta

    def _decode(self, token_ids) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
