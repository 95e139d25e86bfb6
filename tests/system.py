"""The three services as separate local processes, for system tests."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import grpc

from launcher.__main__ import Cluster, start_system
from specdec.v1 import orchestrator_pb2_grpc


class LocalSystem:
    """target + draft + orchestrator processes on loopback, tiny models by default."""

    def __init__(self, target_model="tiny-random:1", draft_model="tiny-random:2", drafter="ngram",
                 target_workers=1, draft_workers=1, log_dir: str | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.args = argparse.Namespace(
            target_model=target_model, draft_model=draft_model, drafter=drafter,
            target_workers=target_workers, draft_workers=draft_workers, port=0, threads=1,
            log_dir=log_dir or tempfile.mkdtemp(prefix="specdec-logs-"), startup_timeout=120.0,
        )
        self.cluster = Cluster(Path(self.args.log_dir))

    def __enter__(self) -> LocalSystem:
        try:
            self.address = start_system(self.args, self.cluster)
        except BaseException:
            self.cluster.stop()
            raise
        self.channel = grpc.insecure_channel(self.address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()
        self.cluster.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(Path(self.args.log_dir).glob("*.log")))
