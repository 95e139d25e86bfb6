"""A TCP proxy that adds a fixed one-way delay in each direction: network latency you
can dial in where kernel `netem` is not available (benchmarks and tests only).

    python -m benchmarks.delay_proxy --listen 127.0.0.1:0 --upstream 127.0.0.1:50051 --delay-ms 5

as a library (a round trip through it takes at least 2 * delay more):

    with DelayProxy("127.0.0.1:50051", delay_ms=5) as proxy:
        channel = grpc.insecure_channel(proxy.address)

or in front of each target of a local system: `start_system(args, cluster,
delayed(layout(args), 5))`.

Each chunk read from one side is stamped with its arrival time and written to the other
side once `delay` has passed since then. Reading goes on while earlier chunks wait, so
the delay is latency, not a throttle: a stream of chunks arrives `delay` later at the
rate it was sent. Order is kept (one queue per direction); a half-close (EOF) is passed
on after the data before it. Timers run on asyncio's event loop: on Linux a delay is
late by up to about 1 ms (epoll's millisecond timeout), never early.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading

from launcher.cluster import Role, free_port

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
_EOF = None  # queued after the last chunk of a direction


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class DelayProxy:
    """Listens on `listen` and forwards every connection to `upstream`, delaying each
    direction by `delay_ms`. `start()` runs it on its own thread and returns the port."""

    def __init__(self, upstream: str, delay_ms: float, listen: str = "127.0.0.1:0"):
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.upstream = split_address(upstream)
        self.delay_s = delay_ms / 1000.0
        self.listen = split_address(listen)
        self.port = 0  # bound port, once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{self.listen[0]}:{self.port}"

    # --- in a thread (library use) --------------------------------------------------

    def start(self) -> int:
        started = threading.Event()
        failure: list[BaseException] = []

        def on_thread() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.serve())
            except BaseException as error:  # noqa: BLE001 - reported to start()
                failure.append(error)
                started.set()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._close())
            self._loop.close()

        self._thread = threading.Thread(target=on_thread, name="delay-proxy", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self.port

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> DelayProxy:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # --- on the event loop ----------------------------------------------------------

    async def serve(self) -> None:
        """Binds the listening socket (sets self.port); connections are served from now."""
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1])
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        upstream_writer = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer),
                self._pipe(upstream_reader, client_writer),
            )
        except (ConnectionError, OSError) as error:
            log.debug("connection ended: %s", error)
        except asyncio.CancelledError:
            pass  # the proxy is stopping (asyncio's stream callback must not see a cancelled task)
        finally:
            self._connections.discard(task)
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copies one direction: a reader task stamps chunks, this one writes them when due."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                while chunk := await reader.read(CHUNK_BYTES):
                    queue.put_nowait((loop.time() + self.delay_s, chunk))
            except (ConnectionError, OSError):
                pass
            queue.put_nowait((loop.time() + self.delay_s, _EOF))

        reading = asyncio.create_task(read())
        try:
            while True:
                due, chunk = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if chunk is _EOF:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()
        finally:
            reading.cancel()


def delayed(roles: list[Role], delay_ms: float) -> list[Role]:
    """The roles of `launcher.cluster.layout` with a delay proxy in front of each target:
    the target advertises the proxy's address, and the drafts and orchestrators reach it
    through the proxy only (the orchestrator's Decode streams too)."""
    if delay_ms <= 0:
        return roles
    through: dict[str, str] = {}  # a target's own address -> its proxy's
    out = []
    for role in roles:
        if role.pool == "target":
            address = f"127.0.0.1:{free_port()}"
            flags = ["--listen", address, "--upstream", role.address, "--delay-ms", str(delay_ms)]
            out.append(
                Role(f"{role.name}-delay", "proxy", "benchmarks.delay_proxy", flags, address)
            )
            through[role.address] = address
            role.args += ["--advertise-address", address]
            role.address = address  # health-checked through the proxy too
        out.append(role)
    for role in out:
        if role.pool == "orchestrator" and "--target-addresses" in role.args:
            at = role.args.index("--target-addresses") + 1
            role.args[at] = ",".join(through.get(a, a) for a in role.args[at].split(","))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.delay_proxy", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--listen", default="127.0.0.1:0", help="host:port to accept on (port 0: any free port)"
    )
    parser.add_argument("--upstream", required=True, help="host:port to forward to")
    parser.add_argument(
        "--delay-ms", type=float, required=True, help="one-way delay added in each direction, ms"
    )
    args = parser.parse_args(argv)
    proxy = DelayProxy(args.upstream, args.delay_ms, args.listen)
    proxy.start()
    # One parseable line for launchers: where to connect.
    print(
        f"delay proxy listening on {proxy.address} -> {args.upstream}, {args.delay_ms:g} ms each way",
        flush=True,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
