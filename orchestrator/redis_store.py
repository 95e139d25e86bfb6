"""Sessions in Redis, for several orchestrator replicas.

Each session is one JSON value under `specdec:session:<id>` that expires after the idle
TTL. A call that advances a session first takes its lease, `specdec:lease:<id>` (SET NX
with a random token and a short TTL, renewed in the background while the call runs);
saving and deleting are Lua scripts that check the token first (a fencing token), so a
replica whose lease expired, e.g. across a long Redis outage, cannot overwrite the work
of the replica that took the session over. Redis must persist (AOF) for sessions to
survive a restart of Redis itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading

import redis

from orchestrator.store import Lease, SessionRecord, SessionStore, busy, not_found
from service_common.redis_client import connect, unavailable_on_error
from service_common.security import Tls

log = logging.getLogger(__name__)

RECORD_KEY = "specdec:session:{}"
LEASE_KEY = "specdec:lease:{}"
# The ids of an API key's sessions; ids whose record expired are pruned when counted.
OWNER_KEY = "specdec:owner:{}"

# KEYS: record, lease, owner's index; ARGV: token ("" = a new session, no lease), value,
# ttl ms, session id, owner ("" = none).
SAVE_IF_LEASED = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if ARGV[5] ~= '' then
  redis.call('SADD', KEYS[3], ARGV[4])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
return 1
"""
# KEYS: record, lease; ARGV: token.
DELETE_IF_LEASED = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
# KEYS: lease; ARGV: token, ttl ms (renew) -- or only token (release).
RENEW_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


class RedisSessionStore(SessionStore):
    def __init__(self, url: str, ttl_s: float, lease_ttl_s: float, tls: Tls | None = None):
        self.url = url
        self.client = connect(url, tls)
        self._ttl_ms = int(ttl_s * 1000)
        self._lease_ttl_ms = int(lease_ttl_s * 1000)
        self._save = self.client.register_script(SAVE_IF_LEASED)
        self._delete = self.client.register_script(DELETE_IF_LEASED)
        self._renew = self.client.register_script(RENEW_LEASE)
        self._release = self.client.register_script(RELEASE_LEASE)
        self._held: dict[str, Lease] = {}  # leases this replica holds, renewed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew_forever, name="lease-renewal", daemon=True
        )
        self._renewer.start()

    def put(self, record: SessionRecord, lease: Lease | None = None) -> None:
        value = json.dumps(record.to_json())
        with unavailable_on_error(self.url, f"saving session {record.session_id!r}"):
            saved = self._save(
                keys=[*self._keys(record.session_id), OWNER_KEY.format(record.owner)],
                args=[
                    lease.token if lease else "",
                    value,
                    self._ttl_ms,
                    record.session_id,
                    record.owner,
                ],
            )
        if not saved:
            lease.lost = True
            raise busy(record.session_id)

    def get(self, session_id: str) -> SessionRecord:
        with unavailable_on_error(self.url, f"reading session {session_id!r}"):
            value = self.client.get(RECORD_KEY.format(session_id))
        if value is None:
            raise not_found(session_id)
        return SessionRecord.from_json(json.loads(value))

    def delete(self, session_id: str, lease: Lease) -> None:
        with unavailable_on_error(self.url, f"deleting session {session_id!r}"):
            if not self._delete(keys=self._keys(session_id), args=[lease.token]):
                lease.lost = True
                raise busy(session_id)

    @contextlib.contextmanager
    def lease(self, session_id: str):
        lease = Lease(session_id)
        with unavailable_on_error(self.url, f"locking session {session_id!r}"):
            taken = self.client.set(
                LEASE_KEY.format(session_id), lease.token, nx=True, px=self._lease_ttl_ms
            )
        if not taken:
            raise busy(session_id)
        with self._lock:
            self._held[lease.token] = lease
        try:
            yield lease
        finally:
            with self._lock:
                self._held.pop(lease.token, None)
            try:
                self._release(keys=[LEASE_KEY.format(session_id)], args=[lease.token])
            except redis.RedisError as error:  # it expires by itself
                log.warning("releasing the lease of %s: %s", session_id, error)

    def count_owned(self, owner: str) -> int:
        index = OWNER_KEY.format(owner)
        with unavailable_on_error(self.url, f"counting the sessions of {owner!r}"):
            ids = [i.decode() for i in self.client.smembers(index)]
            with self.client.pipeline(transaction=False) as pipe:
                for session_id in ids:
                    pipe.exists(RECORD_KEY.format(session_id))
                alive = pipe.execute() if ids else []
            gone = [i for i, exists in zip(ids, alive) if not exists]
            if gone:
                self.client.srem(index, *gone)
        return len(ids) - len(gone)

    def close(self) -> None:
        self._stop.set()

    def _keys(self, session_id: str) -> list[str]:
        return [RECORD_KEY.format(session_id), LEASE_KEY.format(session_id)]

    def _renew_forever(self) -> None:
        while not self._stop.wait(self._lease_ttl_ms / 3000):
            with self._lock:
                leases = list(self._held.values())
            for lease in leases:
                try:
                    if not self._renew(
                        keys=[LEASE_KEY.format(lease.session_id)],
                        args=[lease.token, self._lease_ttl_ms],
                    ):
                        lease.lost = True
                except redis.RedisError:
                    pass  # Redis is away; the save at the end will say so
