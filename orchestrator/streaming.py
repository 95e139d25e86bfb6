"""Committed tokens in, the chunks a client is streamed out: text that is final, the
tokens behind it with how each was produced, cut before the first stop string."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field

from orchestrator.rounds import Generated
from orchestrator.text import TextAssembler
from specdec.v1 import common_pb2

STOP_STRING = common_pb2.FINISH_REASON_STOP_STRING
CANCELLED = common_pb2.FINISH_REASON_CANCELLED


@dataclass
class Chunk:
    token_ids: list[int]
    text_delta: str
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED  # set on the last chunk
    stats: common_pb2.GenerationStats | None = None  # on the last chunk
    sources: list[int] = field(default_factory=list)  # TokenSource of each of token_ids
    texts: list[str] = field(default_factory=list)  # the part of text_delta of each of token_ids
    num_drafted: int = 0  # draft tokens of the rounds that end in this chunk
    num_prompt_tokens: int = 0  # on the last chunk


class TextStream:
    """Turns the rounds' tokens into chunks; the assembler keeps what the session commits."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], generated: Generated):
        self.assembler = TextAssembler(tokenizer, stop_strings)
        self.generated = generated  # the tokens' sources and drafted counts, filled by the rounds
        self.sent = 0  # tokens released to the client so far

    def chunks(
        self,
        rounds: Iterable[tuple[list[int], int]],
        client_active: Callable[[], bool],
        cancel_rounds: Callable[[], None],
    ) -> Generator[Chunk, None, int]:
        """A chunk per round that made text final; returns the finish reason: the last
        round's, a stop string's, or the client's cancel."""
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        for token_ids, finish in rounds:
            released, delta = self.assembler.add(token_ids)
            stopped = self.assembler.stopped_at is not None
            if stopped:
                cancel_rounds()  # the workers would generate past the stop for nothing
                finish = STOP_STRING
            if released or delta:  # on a stop too: the text before it in this round
                yield self._chunk(released, delta)
            if stopped:
                return finish
            if not client_active():
                return CANCELLED
        return finish

    def last_chunk(self) -> Chunk:
        """The text held back until the end (up to the stop string, if one hit)."""
        return self._chunk(*self.assembler.finish())

    def _chunk(self, released: list[int], delta: str) -> Chunk:
        begin, self.sent = self.sent, self.sent + len(released)
        return Chunk(
            released,
            delta,
            sources=self.generated.sources[begin : self.sent],
            texts=self.assembler.pieces,
            num_drafted=sum(self.generated.drafted[begin : self.sent]),
        )
