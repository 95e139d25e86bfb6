"""The session cache both workers keep: LRU eviction under the session and the token
budget, one call at a time per session, and the target's reservations."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import pytest

from foundation.errors import NotFound, ResourceExhausted
from service_common.session_cache import CachedSession, SessionCache
from service_common.status import AlreadyExists, SessionBusy


@dataclass(eq=False)
class Tokens(CachedSession):
    """A session that is only its committed tokens."""

    tokens: int = 0  # committed tokens, in tokens
    released: bool = False

    @property
    def length(self) -> int:
        return self.tokens

    def release(self) -> None:
        self.released = True


def draft_cache(max_sessions: int, max_cached_tokens: int) -> SessionCache[Tokens]:
    return SessionCache("draft", max_sessions, max_cached_tokens, evicts_in_use=False)


def target_cache(max_sessions: int, max_cached_tokens: int) -> SessionCache[Tokens]:
    return SessionCache("target", max_sessions, max_cached_tokens, evicts_in_use=True)


def add(cache: SessionCache[Tokens], session_id: str, tokens: int) -> Tokens:
    """As the draft worker opens a session: room first, then the session made and added."""
    cache.make_room(tokens)
    entry = Tokens(session_id, tokens)
    cache.add(entry)
    return entry


def open_(cache: SessionCache[Tokens], session_id: str, tokens: int) -> Tokens:
    """As the target worker opens a session: added with its prompt reserved, then prefilled."""
    with cache.adding(Tokens(session_id), tokens) as entry:
        entry.tokens = tokens
    return entry


@contextlib.contextmanager
def held(cache: SessionCache[Tokens], session_id: str, stoppable: bool = False):
    """The session held by a call on another thread for the block (stoppable: until the
    cache stops it); yields the event that ends the call."""
    holding, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with cache.locked(session_id, stop=let_go if stoppable else None):
            holding.set()
            let_go.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(5)
    try:
        yield let_go
    finally:
        let_go.set()
        thread.join(5)


def test_evicts_least_recently_used_idle_sessions():
    cache = draft_cache(max_sessions=2, max_cached_tokens=10)
    a, b = add(cache, "a", 3), add(cache, "b", 3)
    with cache.locked("a", wait_s=1.0):  # "a" is now the most recently used
        pass
    add(cache, "c", 3)  # a third session: "b" goes
    assert b.released and not a.released
    with pytest.raises(NotFound, match="evicted or never opened"):
        with cache.locked("b", wait_s=1.0):
            pass
    with cache.locked("c", wait_s=1.0) as in_use:  # in use: never evicted
        cache.make_room(5, keep=in_use)  # 3 + 3 + 5 > 10 tokens: "a" goes
        assert len(cache) == 1 and a.released
    assert cache.load().cached_tokens == 3


def test_a_busy_session_raises_session_busy():
    cache = draft_cache(max_sessions=4, max_cached_tokens=100)
    add(cache, "a", 3)
    with held(cache, "a"):
        with pytest.raises(SessionBusy, match="busy"):
            with cache.locked("a", wait_s=0.05):
                pass
        with pytest.raises(SessionBusy, match="busy"):
            cache.close("a", wait_s=0.05)
    with cache.locked("a", wait_s=1.0) as entry:
        assert entry.length == 3
    assert cache.close("a", wait_s=1.0) and entry.released
    assert not cache.close("a", wait_s=1.0)


def test_sessions_in_use_are_never_evicted_when_not_evicts_in_use():
    cache = draft_cache(max_sessions=1, max_cached_tokens=100)
    a = add(cache, "a", 3)
    with held(cache, "a"):
        with pytest.raises(ResourceExhausted, match="full"):
            cache.make_room(3)
    assert len(cache) == 1 and not a.released


def test_a_taken_id_already_exists_and_the_new_entry_is_released():
    cache = draft_cache(max_sessions=4, max_cached_tokens=100)
    add(cache, "a", 3)
    twin = Tokens("a", 1)
    with pytest.raises(AlreadyExists, match="'a' already exists"):
        cache.add(twin)
    assert twin.released


def test_reservations_count_against_the_budget_until_the_call_ends():
    cache = target_cache(max_sessions=4, max_cached_tokens=10)
    a, b = open_(cache, "a", 3), open_(cache, "b", 3)
    with cache.locked("b", growth=4) as entry:  # 3 + 4 reserved; "a" is least recently used
        assert cache.load().cached_tokens == 6  # committed tokens, what the load reports
        open_(cache, "c", 1)  # 3 + 7 + 1 > 10 tokens: "a" goes
        assert a.released and not b.released
        entry.tokens = 5  # the call commits 2 of its 4
    d = open_(cache, "d", 4)  # 5 + 1 + 4: the rest of the reservation was given back
    assert not (b.released or d.released) and cache.load().cached_tokens == 10
    with pytest.raises(ResourceExhausted, match="would hold 11 tokens"):
        with cache.locked("b", growth=6):
            pass


def test_a_stoppable_call_reserves_what_room_there_is():
    cache = target_cache(max_sessions=4, max_cached_tokens=10)
    open_(cache, "x", 8)
    y = open_(cache, "y", 1)
    with pytest.raises(ResourceExhausted, match="would hold 13 tokens"):
        with cache.locked("x", growth=5):
            pass
    assert not y.released
    with cache.locked("x", growth=5, stop=threading.Event()):  # 2 reserved: 8 + 2 + 1 > 10
        assert y.released


def test_evicting_a_session_in_use_stops_its_call_and_waits_for_it():
    cache = target_cache(max_sessions=2, max_cached_tokens=100)
    a, b = open_(cache, "a", 3), open_(cache, "b", 3)
    with held(cache, "a", stoppable=True) as stop:
        with cache.locked("b"):  # "a" is least recently used again
            pass
        open_(cache, "c", 1)  # a third session: "a" goes, in use
        assert stop.is_set() and a.released and not b.released
    with pytest.raises(NotFound, match="evicted"):
        with cache.locked("a"):
            pass


def test_closing_a_session_in_use_stops_its_call_when_evicts_in_use():
    cache = target_cache(max_sessions=2, max_cached_tokens=100)
    a = open_(cache, "a", 3)
    with held(cache, "a", stoppable=True) as stop:
        assert cache.close("a") and stop.is_set() and a.released
    assert not cache.close("a") and len(cache) == 0
