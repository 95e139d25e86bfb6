"""A local system: the flags that describe it, its processes' layout, starting and stopping them.

`python -m launcher` is a thin command over this module; the tests and benchmarks start
their systems through it too.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from foundation.progress import progress_messages
from model_runtime.quantization import SELF_QUANTIZATION, resolve_draft
from service_common.security import Tls, TlsFiles, write_throwaway_pki
from service_common.server import channel
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

# How often a wait looks again: a server is seen within this of serving (the channels'
# reconnect backoff is capped too, service_common/server.py CHANNEL_OPTIONS).
POLL_S = 0.1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class ProgressEcho:
    """Shows on the launcher's console the progress lines its processes log while they
    start (a first start converts and loads models for minutes), read from their log
    files as these grow (foundation/progress.py writes them, `progress_messages` finds them)."""

    def __init__(self, console=None):
        self.console = console  # None: sys.stderr at the time of each line
        self.followed: dict[str, tuple[Path, int]] = {}  # name -> (its log file, bytes read)

    def follow(self, name: str, log_file: Path) -> None:
        """From the file's end as it is: a restarted process's earlier lines were shown."""
        self.followed[name] = (log_file, log_file.stat().st_size)

    def echo(self) -> None:
        for name, (log_file, read) in self.followed.items():
            with log_file.open("rb") as log:
                log.seek(read)
                text = log.read()
            # A line still being written waits for its end (a tqdm redraw ends with a \r).
            ended = text[: max(text.rfind(b"\n"), text.rfind(b"\r")) + 1]
            self.followed[name] = (log_file, read + len(ended))
            for message in progress_messages(ended.decode(errors="replace")):
                print(f"  {name}: {message}", file=self.console or sys.stderr, flush=True)


class Cluster:
    """Child processes of one local system; stops them all on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.tls: Tls | None = None  # a TLS system: health checks present the client certificate
        self.progress = ProgressEcho()  # what the processes log of their start, while waiting
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, module: str, args: list[str], cpus: frozenset[int] | None = None
    ) -> None:
        """cpus: the cores the process (and every thread it starts) may run on; None: any."""
        restarted = any(n == name for n, _ in self.processes)
        log = open(self.log_dir / f"{name}.log", "a" if restarted else "w")
        self.progress.follow(name, self.log_dir / f"{name}.log")
        # Pinned before exec, so that torch's and gRPC's thread pools inherit it.
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=pin,
        )
        self.processes.append((name, process))

    def wait_healthy(
        self, name: str, address: str, timeout_s: float, sees: Sequence[str] = ()
    ) -> None:
        """Waits for SERVING on the gRPC health service at address, or for a 200 from an
        http:// address (the HTTP API's /health)."""
        deadline = time.monotonic() + timeout_s
        if address.startswith("http://"):
            return self._poll(
                name, lambda: _http_ok(address), deadline, f"not healthy at {address}"
            )
        stub = health_pb2_grpc.HealthStub(channel(address, self.tls))
        self._poll(name, lambda: _serving(stub), deadline, f"not healthy at {address}")
        self._wait_seen(name, address, sees, deadline)

    def _poll(self, name: str, ready, deadline: float, what: str) -> None:
        """Until ready() while the process runs; SystemExit naming its log otherwise."""
        process = dict(self.processes)[name]
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self.progress.echo()
                raise SystemExit(
                    f"{name} exited with {process.returncode}; see {self.log_dir / (name + '.log')}"
                )
            serving = ready()
            self.progress.echo()  # after the look, so that all it logged before serving shows
            if serving:
                return
            time.sleep(POLL_S)
        raise SystemExit(f"{name} {what} by its startup deadline; see {self.log_dir}")

    def _wait_seen(self, name: str, address: str, workers: Sequence[str], deadline: float) -> None:
        """Until the orchestrator at address holds every worker address in its pools (it
        reads them every --worker-refresh-s: one that just began serving may be unknown)."""
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel(address, self.tls))
        missing = set(workers)
        while missing:
            try:
                listed = stub.ListWorkers(
                    orchestrator_pb2.ListWorkersRequest(), timeout=1.0
                ).workers
                missing -= {worker.address for worker in listed}
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE and error.details():
                    # It serves but cannot read its registry (Redis down): its calls say so
                    # until Redis is back; waiting here would only hide that.
                    print(f"{name}: {error.details()}", file=sys.stderr)
                    return
            if missing and time.monotonic() > deadline:
                raise SystemExit(
                    f"{name} at {address} does not see {sorted(missing)}; see {self.log_dir}"
                )
            if missing:
                time.sleep(POLL_S)

    def stop(self) -> None:
        for _, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def _serving(stub) -> bool:
    try:
        return (
            stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            return reply.status == 200
    except OSError:  # refused, or 503 (HTTPError) until the orchestrator serves
        return False


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m launcher",
        description="Target, draft, orchestrator and HTTP API as local processes, health-checked.",
    )
    parser.add_argument("--target-model", default="smollm2-135m")
    parser.add_argument(
        "--draft-model",
        default="",
        help="model for the 'model' drafter; 'self' = the target's own weights, quantized; "
        "empty = n-gram only",
    )
    parser.add_argument(
        "--draft-quantization",
        default="",
        help="the draft model's linears (model_runtime/quantization.py: none, int8-dynamic, ...); "
        f"empty = {SELF_QUANTIZATION} for a 'self' draft, none otherwise",
    )
    parser.add_argument(
        "--draft-keep-output-layer",
        action="store_true",
        help="leave the draft model's output layer unquantized",
    )
    parser.add_argument(
        "--draft-pipeline",
        choices=("auto", "on", "off"),
        default="auto",
        help="draft the next proposal while the last is verified; auto = off with a draft "
        "model (here every role shares this host's cores, and drafting ahead would slow "
        "the target's passes), on for n-gram lookup (it costs no compute)",
    )
    parser.add_argument("--drafter", default="ngram", help="the draft workers' default drafter")
    parser.add_argument(
        "--draft-tree-width",
        type=int,
        default=None,
        help="continuations a round may propose as a token tree, verified in one target pass "
        "(docs/speculation.md, 'Token trees'); default: the draft worker's (1, chains)",
    )
    parser.add_argument(
        "--target-dtype",
        default="float32",
        help="the target's weights: float32 (here the default, for runs comparable across hosts), "
        "bfloat16, float16, or auto (the worker's own default: bfloat16 on a GPU and on a CPU "
        "with AMX, exact there with row invariance; `make run` uses it)",
    )
    parser.add_argument(
        "--target-row-invariant",
        choices=("auto", "on", "off"),
        default="auto",
        help="the target's rows computed the same whatever the pass, so that speculation cannot "
        "change a greedy token (docs/speculation.md, Exactness); auto = on where it costs "
        "little (bf16 on a CPU)",
    )
    parser.add_argument("--target-workers", type=int, default=1)
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="ranks each target worker's model is sharded over (processes here, GPUs in a cluster)",
    )
    parser.add_argument("--draft-workers", type=int, default=1)
    parser.add_argument(
        "--orchestrators",
        type=int,
        default=1,
        help="orchestrator replicas (more than 1 needs Redis)",
    )
    parser.add_argument(
        "--redis-url",
        default="",
        help="shared Redis: sessions and the worker registry (e.g. redis://127.0.0.1:6379/0); "
        "empty = sessions in memory, worker addresses passed to one orchestrator",
    )
    parser.add_argument(
        "--heartbeat-s", type=float, default=1.0, help="worker heartbeat period, with --redis-url"
    )
    parser.add_argument(
        "--heartbeat-ttl-s", type=float, default=5.0, help="registration lifetime without heartbeat"
    )
    parser.add_argument(
        "--port", type=int, default=50050, help="the first orchestrator's port (0 = any free port)"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the OpenAI-compatible HTTP API and playground (python -m http_api), started after "
        "the orchestrator: 0 = any free port (also when this one is taken), -1 = none",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between all roles and TLS to the orchestrator, with a throwaway CA and "
        "certificates made in LOG_DIR/tls (the client needs --tls-ca LOG_DIR/tls/ca.pem)",
    )
    parser.add_argument(
        "--api-keys",
        default="",
        metavar="FILE",
        help="the orchestrator's API keys file (python -m service_common.auth add NAME FILE); "
        "the client then needs --api-key",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker (0 = default)"
    )
    parser.add_argument(
        "--cpus",
        action="append",
        default=[],
        type=parse_cpus,
        metavar="POOL=LIST",
        help="pin a pool's processes (target, draft, orchestrator, http, proxy) to cores, "
        "e.g. target=0 or draft=2-3,6 (repeatable; a pool not named runs anywhere)",
    )
    parser.add_argument("--log-dir", default=".run/logs")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument(
        "--prompt", default=None, help="generate once through the client, then stop"
    )
    parser.add_argument(
        "client_args", nargs=argparse.REMAINDER, help="after --: flags for the client"
    )
    return parser.parse_args(argv)


def parse_cpus(text: str) -> tuple[str, frozenset[int]]:
    """'POOL=LIST' (LIST as taskset's: 0,2-3) -> (pool, cores)."""
    pool, _, spec = text.partition("=")
    try:
        cores = set()
        for part in spec.split(","):
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        cores = set()
    if not pool or not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"expected POOL=LIST such as target=0,2-3, got {text!r}")
    return pool, frozenset(cores)


def pool_cpus(args, pool: str) -> frozenset[int] | None:
    """The cores --cpus gives the pool (the last naming it), None where none does."""
    return dict(getattr(args, "cpus", ())).get(pool)


def draft_flags(args) -> list[str]:
    """The draft workers' model flags: 'self' resolved to the target's model, its
    quantization, token trees, and drafting ahead as --draft-pipeline says."""
    model, quantization = resolve_draft(
        args.draft_model, args.draft_quantization, args.target_model
    )
    flags = ["--model", model, "--default-drafter", args.drafter]
    flags += (
        ["--tree-width", str(args.draft_tree_width)] if args.draft_tree_width is not None else []
    )
    if model:
        flags += ["--quantization", quantization]
        flags += ["--keep-output-layer"] if args.draft_keep_output_layer else []
    if args.draft_pipeline == "off" or (args.draft_pipeline == "auto" and model):
        flags += ["--disable", "pipeline"]
    return flags


@dataclass
class Role:
    """One process of the system: its name, module, flags and gRPC address."""

    name: str
    pool: str  # "target", "draft" or "orchestrator"
    module: str
    args: list[str]
    address: str


def target_flags(args) -> list[str]:
    parallel = (
        ["--tensor-parallel", str(args.tensor_parallel)]
        if getattr(args, "tensor_parallel", 1) > 1
        else []
    )
    precision = [
        "--dtype",
        getattr(args, "target_dtype", "float32"),
        "--row-invariant",
        getattr(args, "target_row_invariant", "auto"),
    ]
    return ["--model", args.target_model, *precision, *parallel]


def layout(args) -> list[Role]:
    """The processes to start for args, each on a free port: workers first."""
    if args.orchestrators > 1 and not args.redis_url:
        raise SystemExit("several orchestrators share sessions through Redis: give --redis-url")
    registry = (
        [
            "--redis-url",
            args.redis_url,
            "--heartbeat-s",
            str(args.heartbeat_s),
            "--heartbeat-ttl-s",
            str(args.heartbeat_ttl_s),
        ]
        if args.redis_url
        else []
    )
    tls = tls_files(args)
    roles = []
    for pool, count, module, flags in (
        ("target", args.target_workers, "target_service", target_flags(args)),
        ("draft", args.draft_workers, "draft_service", draft_flags(args)),
    ):
        for index in range(count):
            address = f"127.0.0.1:{free_port()}"
            worker_flags = [
                *flags,
                "--address",
                address,
                "--threads",
                str(args.threads),
                *registry,
                *(tls[pool].flags() if tls else []),
            ]
            roles.append(Role(f"{pool}-{index}", pool, module, worker_flags, address))
    if args.redis_url:
        discovery = [
            "--redis-url",
            args.redis_url,
            "--worker-refresh-s",
            str(min(1.0, args.heartbeat_s)),
        ]
    else:
        discovery = [
            "--target-addresses",
            ",".join(r.address for r in roles if r.pool == "target"),
            "--draft-addresses",
            ",".join(r.address for r in roles if r.pool == "draft"),
        ]
    for index in range(args.orchestrators):
        port = args.port if index == 0 and args.port else free_port()
        address = f"127.0.0.1:{port}"
        name = "orchestrator" if index == 0 else f"orchestrator-{index}"
        security = [
            *(tls["orchestrator"].flags() if tls else []),
            *(["--api-keys-file", str(Path(args.api_keys).resolve())] if args.api_keys else []),
        ]
        roles.append(
            Role(
                name,
                "orchestrator",
                "orchestrator",
                ["--address", address, *discovery, *security],
                address,
            )
        )
    if args.http_port >= 0:
        roles.append(_http_api(args, next(r.address for r in roles if r.pool == "orchestrator")))
    return roles


def _http_api(args, orchestrator: str) -> Role:
    port = args.http_port if args.http_port and port_is_free(args.http_port) else free_port()
    address = f"127.0.0.1:{port}"
    tls = tls_files(args)  # the front calls the orchestrator with the client certificate
    return Role(
        "http",
        "http",
        "http_api",
        [
            "--address",
            address,
            "--orchestrator-address",
            orchestrator,
            *(tls["client"].flags() if tls else []),
        ],
        address,
    )


def tls_files(args) -> dict[str, TlsFiles] | None:
    """Where a TLS system's certificates are (LOG_DIR/tls), per role; None without --tls."""
    if not args.tls:
        return None
    directory = Path(args.log_dir).resolve() / "tls"
    return {
        role: TlsFiles(
            str(directory / f"{role}.pem"),
            str(directory / f"{role}-key.pem"),
            str(directory / "ca.pem"),
        )
        for role in ("orchestrator", "target", "draft", "client")
    }


def start_system(args, cluster: Cluster, roles: list[Role] | None = None) -> str:
    """Starts every role (of layout(args) unless given); returns the first orchestrator's
    address once all are healthy."""
    roles = roles or layout(args)
    tls = tls_files(args)
    if tls:  # a throwaway CA and a certificate per role, made anew for each run
        write_throwaway_pki(Path(tls["client"].ca).parent)
        cluster.tls = tls["client"].load()
    workers = [r for r in roles if r.pool not in ("orchestrator", "http")]
    orchestrators = [r for r in roles if r.pool == "orchestrator"]
    # Every role at once: an orchestrator serves before its workers do (its calls get
    # UNAVAILABLE until a target is there) and the models load side by side. With API
    # keys the launcher cannot ask an orchestrator which workers it holds: it starts
    # once they serve, and then holds them from its first look.
    together = [] if args.api_keys else orchestrators
    for role in [*workers, *together]:
        cluster.start(role.name, role.module, role.args, pool_cpus(args, role.pool))
    for role in workers:
        if role.pool != "proxy":  # a proxy (benchmarks/delay_proxy.py): its target through it
            cluster.wait_healthy(role.name, role.address, args.startup_timeout)
    for role in orchestrators:
        if role not in together:
            cluster.start(role.name, role.module, role.args, pool_cpus(args, role.pool))
    # Ready = serving and holding every worker: the first call is placed as later ones are.
    pooled = [r.address for r in workers if r.pool in ("target", "draft")] if together else []
    for role in orchestrators:
        cluster.wait_healthy(role.name, role.address, args.startup_timeout, sees=pooled)
    for role in (r for r in roles if r.pool == "http"):  # the HTTP API, once an orchestrator serves
        cluster.start(role.name, role.module, role.args, pool_cpus(args, role.pool))
        cluster.wait_healthy(role.name, f"http://{role.address}/health", args.startup_timeout)
    return orchestrators[0].address
