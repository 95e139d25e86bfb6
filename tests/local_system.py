"""The services as separate local processes, for system tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import grpc

from benchmarks.delay_proxy import delayed
from launcher.cluster import Cluster, layout, parse_args, start_system
from service_common.server import channel
from specdec.v1 import orchestrator_pb2_grpc


class LocalSystem:
    """Target, draft and orchestrator processes on loopback, tiny models by default;
    any launcher option can be given (redis_url, orchestrators, target_workers, ...);
    draft_target_delay_ms puts a delaying proxy in front of each target."""

    def __init__(
        self,
        target_model="tiny-random:1",
        draft_model="tiny-random:2",
        log_dir: str | None = None,
        draft_target_delay_ms: float = 0.0,
        **launcher_options,
    ):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.args = parse_args([])
        self.args.target_model, self.args.draft_model = target_model, draft_model
        self.args.port, self.args.threads, self.args.startup_timeout = 0, 1, 120.0
        # no HTTP API unless a test asks for one (http_port=0: any free port)
        self.args.http_port = -1
        self.args.log_dir = log_dir or tempfile.mkdtemp(prefix="specdec-logs-")
        for name, value in launcher_options.items():
            if not hasattr(self.args, name):
                raise TypeError(f"unknown launcher option {name!r}")
            setattr(self.args, name, value)
        self.cluster = Cluster(Path(self.args.log_dir))
        self.roles = delayed(layout(self.args), draft_target_delay_ms)
        self.channels: list[grpc.Channel] = []

    def __enter__(self) -> LocalSystem:
        try:
            self.address = start_system(self.args, self.cluster, self.roles)
        except BaseException:
            self.cluster.stop()
            raise
        self.stub = self.orchestrator(0)
        return self

    def __exit__(self, *exc) -> None:
        for open_channel in self.channels:
            open_channel.close()
        self.cluster.stop()

    def orchestrator(self, index: int):
        """A stub of the index-th orchestrator replica (over TLS, with the client's
        certificate, in a system started with tls=True)."""
        address = [r.address for r in self.roles if r.pool == "orchestrator"][index]
        self.channels.append(channel(address, self.cluster.tls))
        return orchestrator_pb2_grpc.OrchestratorStub(self.channels[-1])

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP API (started with http_port=0)."""
        return "http://" + next(r.address for r in self.roles if r.pool == "http")

    def role(self, address: str):
        return next(r for r in self.roles if r.address == address)

    def process(self, name: str):
        """The latest process started under name."""
        return [p for n, p in self.cluster.processes if n == name][-1]

    def restart(self, name: str) -> None:
        """Starts a stopped or killed role again, same flags and address, and waits for it."""
        role = next(r for r in self.roles if r.name == name)
        self.cluster.start(role.name, role.module, role.args)
        self.cluster.wait_healthy(role.name, role.address, self.args.startup_timeout)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}"
            for p in sorted(Path(self.args.log_dir).glob("*.log"))
        )
