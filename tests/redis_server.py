"""A real redis-server on a free port, for the tests of the Redis store and the pools.

It persists with AOF into its own directory, so that stopping and starting it again (a
Redis outage) keeps the sessions, as a deployment configured like deploy/ does.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import redis

from launcher.cluster import free_port

INSTALL_HINT = "redis-server is not installed: `apt-get install redis-server` (make setup does it)"


class RedisServer:
    def __init__(self):
        self.binary = shutil.which("redis-server") or shutil.which(
            "redis-server", path="/usr/sbin:/usr/bin"
        )
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="specdec-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.dir,
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--logfile",
                "redis.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start; see {self.dir}/redis.log"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM): the AOF is complete, as after a restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
