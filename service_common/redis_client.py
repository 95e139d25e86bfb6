"""One way to reach Redis: a client that retries with backoff, and errors that name it.

redis-py reconnects by itself once Redis is back; a call made while it is down is
retried a few times (exponential backoff), then fails with `Unavailable` naming Redis,
which the services turn into UNAVAILABLE for their callers.
"""

from __future__ import annotations

import contextlib
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from service_common.security import Tls
from service_common.status import Unavailable

# About 1.5 s of retries (0.05, 0.1, 0.2, 0.4, 0.8 s) before a call gives up: long
# enough to ride over a failover of a managed Redis, short against a client's deadline.
RETRIES = 5
BACKOFF = ExponentialBackoff(cap=0.8, base=0.05)


def connect(url: str, tls: Tls | None = None) -> redis.Redis:
    """A client for redis://[:password@]host:port/db, or rediss:// for TLS; connects
    lazily. Over rediss:// with a role's tls, Redis must present a certificate the
    cluster CA signed and is shown the role's own (for a Redis that asks, tls-auth-clients);
    ssl_* query parameters of the URL win (e.g. ?ssl_ca_certs=/path/to/redis-ca.pem)."""
    return redis.Redis.from_url(
        url,
        **_tls_options(url, tls),
        retry=Retry(BACKOFF, RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        health_check_interval=15,
    )


def _tls_options(url: str, tls: Tls | None) -> dict:
    if tls is None or urlsplit(url).scheme != "rediss":
        return {}
    options = {
        "ssl_ca_certs": tls.ca_path,
        "ssl_certfile": tls.cert_path,
        "ssl_keyfile": tls.key_path,
    }
    given = parse_qs(urlsplit(url).query)
    return {name: value for name, value in options.items() if value and name not in given}


def describe(url: str) -> str:
    """ "Redis at host:port" without the password, for messages and logs."""
    parts = urlsplit(url)
    return f"Redis at {parts.hostname or 'localhost'}:{parts.port or 6379}"


@contextlib.contextmanager
def unavailable_on_error(url: str, what: str):
    """Turns any Redis failure inside the block into Unavailable("<what>: Redis at ...")."""
    try:
        yield
    except redis.RedisError as error:
        raise Unavailable(
            f"{what}: {describe(url)} is unavailable ({error}); retry later"
        ) from error
