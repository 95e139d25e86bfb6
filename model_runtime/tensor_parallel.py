"""One model sharded over N processes (tensor parallelism), run in lockstep: on one host,
or over several (each node's ranks started there, rank 0 on the leader).

The sharding is the model's own plan in transformers (`base_model_tp_plan`: q, k, v,
gate and up split by output column, o and down by input row, an all-reduce after each
row-wise layer; the output layer gathered), on torch.distributed: NCCL on CUDA (rank r
on GPU r), gloo on CPU (fp32: gloo cannot all-reduce bf16). Each rank holds 1/N of the
weights and 1/N of every session's KV cache (its own attention heads).

Rank 0 is the worker: it serves, schedules steps, holds the sessions and samples. The
other ranks (`python -m model_runtime.tensor_parallel`, started by rank 0) hold no
session: before each batched pass rank 0 broadcasts what the pass runs (each segment's
tokens and start, which cache it extends) and the cache edits made since that cache's
last pass (a tree's kept path moved into place, a cache freed), and every rank runs the
same pass. Rollback needs no message: a segment starts where its cache was cut back to.

Beyond one node (a LeaderWorkerSet group in Kubernetes, deploy/k8s/overlays/gpu-multinode):
the leader's worker starts its node's ranks 0..L-1 (`--tensor-parallel-local L`), and
each other node runs `python -m model_runtime.tensor_parallel --node-index I
--local-ranks L --master-addr LEADER ...`, ranks I*L..I*L+L-1 on its GPUs 0..L-1, which
dial the leader's rendezvous port (`--tensor-parallel-port`).

Failure is whole: rank 0 watches the other ranks of its node and stops the worker when
one exits (`Ranks.on_lost`); the others die with rank 0 (PR_SET_PDEATHSIG) or at the
next broadcast, which fails once rank 0's sockets close. A rank on another node that
dies fails the next collective; the group is then restarted whole (the
LeaderWorkerSet's RecreateGroupOnPodRestart).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from foundation.errors import InvalidArgument, WorkerLost
from model_runtime import loading
from model_runtime.batched_forward import LOCKSTEP_ATTR, Segment, SequenceKV, forward_segments

log = logging.getLogger(__name__)

# Ranks wait for rank 0's next pass for as long as the worker lives: a dead peer is
# found by its exit (Ranks) or its closed sockets, never by a timeout on an idle worker.
IDLE_TIMEOUT = timedelta(days=365)


def check_shardable(model: PreTrainedModel, world_size: int) -> None:
    """Every rank must hold whole attention heads: N divides the query and key-value heads."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % world_size or kv_heads % world_size:
        raise InvalidArgument(
            f"--tensor-parallel {world_size} must divide the model's {heads} attention heads and "
            f"{kv_heads} key-value heads"
        )


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    master_addr: str = "127.0.0.1",
    local_rank: int | None = None,
) -> dist.ProcessGroup:
    """Joins the ranks' process group at rank 0's master_addr:port (the environment
    transformers reads is set too); returns the gloo group that carries rank 0's
    announcements (small pickles, on the CPU). local_rank: the GPU on this node (default
    rank: one node)."""
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(
            f"tensor parallelism runs on 'cpu' or 'cuda' (rank r on cuda:r), not {device!r}"
        )
    local_rank = rank if local_rank is None else local_rank
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
    )
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend(device), rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def load_shard(name: str, *, device: str, dtype: str, world_size: int) -> loading.LoadedModel:
    """This rank's shard of the model: weights files are read shard by shard by
    transformers; a model made in code is made whole on every rank (the same seed, the
    same weights), then sharded. CPU linears stay unpacked: the plan hooks nn.Linear."""
    from transformers.distributed.configuration_utils import DistributedConfig

    config = DistributedConfig(tp_size=world_size)
    rank_device = f"cuda:{dist.get_rank()}" if device == "cuda" else device
    if loading.is_made_in_code(name):
        loaded = loading.load_model(name, device=rank_device, dtype=dtype, pack_cpu_linears=False)
        check_shardable(loaded.model, world_size)
        model_class = type(loaded.model)
        config, _, mesh = model_class.prepare_distribute_model(config)
        model_class.maybe_distribute_model(loaded.model, config, mesh)
        return loaded
    loaded = loading.load_model(
        name, device=rank_device, dtype=dtype, pack_cpu_linears=False, distributed_config=config
    )
    check_shardable(loaded.model, world_size)
    return loaded


# --- rank 0 -------------------------------------------------------------------------


@dataclass(frozen=True)
class _SegmentCopy:
    cache: int  # which of the follower's caches (numbered by rank 0 at its first pass)
    edits: list[tuple]  # SequenceKV edits since its last pass, in order
    start: int
    token_ids: list[int]
    num_logits: int
    parents: list[int] | None


@dataclass(frozen=True)
class _Pass:
    freed: list[int]  # caches whose sessions are gone
    segments: list[_SegmentCopy]


class Leader:
    """Rank 0's side: announces each pass before running it (batched_forward runs every
    pass inside `announced`, found through the model's LOCKSTEP_ATTR)."""

    def __init__(self, group: dist.ProcessGroup):
        self._group = group
        self._numbers: weakref.WeakKeyDictionary[SequenceKV, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count()
        self._freed: list[int] = []
        self._lock = threading.Lock()  # caches are freed on whichever thread drops them

    def attach(self, model: PreTrainedModel) -> None:
        setattr(model, LOCKSTEP_ATTR, self)

    @contextlib.contextmanager
    def announced(self, segments: Sequence[Segment]) -> Iterator[None]:
        """Announces a pass, which then runs on every rank; a rank gone (a broadcast or
        an all-reduce failing) is WorkerLost: this worker cannot run passes any more."""
        copies = [self._copy(segment) for segment in segments]
        with self._lock:
            freed, self._freed = self._freed, []
        try:
            dist.broadcast_object_list([_Pass(freed, copies)], src=0, group=self._group)
            yield
        except RuntimeError as error:  # gloo and NCCL failures (DistBackendError is one)
            raise WorkerLost(
                f"a tensor-parallel rank of this worker is gone ({_first_line(error)})"
            ) from error

    def _copy(self, segment: Segment) -> _SegmentCopy:
        kv = segment.kv
        number = self._numbers.get(kv)
        if number is None:  # its first pass: from now on its edits are recorded
            number = self._numbers[kv] = next(self._next)
            kv.edits = []
            weakref.finalize(kv, self._free, number)
        edits, kv.edits = kv.edits, []
        return _SegmentCopy(
            number,
            edits,
            segment.start,
            list(segment.token_ids),
            segment.num_logits,
            None if segment.parents is None else list(segment.parents),
        )

    def _free(self, number: int) -> None:
        with self._lock:
            self._freed.append(number)


class Ranks:
    """This node's ranks 1..L-1 as child processes of rank 0 (L = local_ranks, default all
    N: one node; the other nodes start theirs); `on_lost` runs once if one exits while
    the worker serves. port 0: a free one (one node); several nodes need a fixed one."""

    def __init__(
        self,
        world_size: int,
        model: str,
        device: str,
        dtype: str,
        threads: int,
        on_lost: Callable[[int, int], None],
        local_ranks: int = 0,
        master_addr: str = "127.0.0.1",
        port: int = 0,
    ):
        local_ranks = local_ranks or world_size
        if world_size % local_ranks:
            raise InvalidArgument(
                f"--tensor-parallel-local {local_ranks} must divide --tensor-parallel {world_size}: "
                "every node runs as many ranks"
            )
        self.world_size, self.master_addr, self.port = world_size, master_addr, port or _free_port()
        self._closing = threading.Event()
        self.processes = [
            subprocess.Popen(
                rank_command(
                    rank, world_size, self.port, model, device, dtype, threads, master_addr
                ),
                preexec_fn=_die_with_parent,
            )
            for rank in range(1, local_ranks)
        ]
        self._on_lost = on_lost
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {_pid_sentinel(p.pid): rank for rank, p in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self._closing.is_set():
            return
        rank = sentinels[ready[0]]
        code = self.processes[rank - 1].wait()
        log.error("tensor-parallel rank %d exited (status %s): the worker stops", rank, code)
        self._on_lost(rank, code)

    def close(self) -> None:
        """Stops every other rank (the worker is stopping)."""
        self._closing.set()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def rank_command(
    rank: int,
    world_size: int,
    port: int,
    model: str,
    device: str,
    dtype: str,
    threads: int,
    master_addr: str = "127.0.0.1",
    local_rank: int | None = None,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "model_runtime.tensor_parallel",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--port",
        str(port),
        "--master-addr",
        master_addr,
        "--local-rank",
        str(rank if local_rank is None else local_rank),
        "--model",
        model,
        "--device",
        device,
        "--dtype",
        dtype,
        "--threads",
        str(threads),
    ]


def load_rank_zero(name: str, *, device: str, dtype: str, ranks: Ranks) -> loading.LoadedModel:
    """Rank 0's shard, its passes announced to the other ranks."""
    group = join(0, ranks.world_size, ranks.port, device, ranks.master_addr, local_rank=0)
    loaded = load_shard(name, device=device, dtype=dtype, world_size=ranks.world_size)
    Leader(group).attach(loaded.model)
    return loaded


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _pid_sentinel(pid: int) -> int:
    """A file descriptor readable once the process exits (pidfd, Linux 5.3+)."""
    return os.pidfd_open(pid)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Resolved before any fork: a forked child of a threaded process must not load libraries.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when rank 0 exits, however rank 0 ends."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


# --- ranks 1..N-1 ---------------------------------------------------------------------


def follow(model: PreTrainedModel, group: dist.ProcessGroup) -> None:
    """Runs every pass rank 0 announces, on this rank's copies of the caches, until rank 0 stops."""
    caches: dict[int, SequenceKV] = {}
    while True:
        message: list[_Pass | None] = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        announced = message[0]
        if announced is None:
            return
        for number in announced.freed:
            caches.pop(number, None)
        segments = []
        for copy in announced.segments:
            kv = caches.setdefault(copy.cache, SequenceKV())
            for edit in copy.edits:
                _apply(kv, edit)
            segments.append(
                Segment(kv, copy.start, copy.token_ids, copy.num_logits, parents=copy.parents)
            )
        forward_segments(model, segments)


def _apply(kv: SequenceKV, edit: tuple) -> None:
    if edit[0] == "move":
        kv.move(edit[1], edit[2])
    else:
        kv.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_runtime.tensor_parallel",
        description="Tensor-parallel ranks after rank 0: one (--rank, started by the target worker), or a node's "
        "(--node-index with --local-ranks: ranks I*L..I*L+L-1 on this node's GPUs 0..L-1).",
    )
    # A node's defaults are the target worker's settings (TARGET_* variables: in Kubernetes
    # the worker pods read the leader's ConfigMap), so that both sides agree.
    for flag, kind, variable in (
        ("--world-size", int, "TENSOR_PARALLEL"),
        ("--port", int, "TENSOR_PARALLEL_PORT"),
        ("--model", str, "MODEL"),
        ("--device", str, "DEVICE"),
        ("--dtype", str, "DTYPE"),
        ("--threads", int, "THREADS"),
    ):
        default = os.environ.get(f"TARGET_{variable}")
        parser.add_argument(
            flag,
            type=kind,
            default=default,
            required=default is None,
            help=f"default: $TARGET_{variable}",
        )
    parser.add_argument("--rank", type=int, default=-1, help="this process's rank (one rank)")
    parser.add_argument(
        "--local-rank", type=int, default=-1, help="its GPU on this node (default: --rank)"
    )
    parser.add_argument(
        "--node-index", type=int, default=-1, help="this node's place in the group (1..): its ranks"
    )
    parser.add_argument(
        "--local-ranks",
        type=int,
        default=int(os.environ.get("TARGET_TENSOR_PARALLEL_LOCAL") or 1),
        help="ranks per node, with --node-index (default: $TARGET_TENSOR_PARALLEL_LOCAL or 1)",
    )
    parser.add_argument(
        "--master-addr", default="127.0.0.1", help="where rank 0 listens (the leader's address)"
    )
    args = parser.parse_args(argv)
    args.dtype = loading.resolve_dtype(
        args.dtype, args.device, sharded=True
    )  # TARGET_DTYPE may say auto
    if args.node_index >= 0:
        return run_node(args)
    if args.rank < 1:
        parser.error("give --rank R (R >= 1) or --node-index I --local-ranks L")
    logging.basicConfig(level=logging.INFO, format=f"rank {args.rank}: %(levelname)s %(message)s")
    loading.configure_threads(args.threads)
    local_rank = args.rank if args.local_rank < 0 else args.local_rank
    group = join(args.rank, args.world_size, args.port, args.device, args.master_addr, local_rank)
    loaded = load_shard(
        args.model, device=args.device, dtype=args.dtype, world_size=args.world_size
    )
    try:
        follow(loaded.model, group)
    except RuntimeError as error:  # rank 0 is gone: its sockets closed (DistBackendError is one)
        log.info("rank 0 is gone (%s): stopping", _first_line(error))
        return 1
    return 0


def run_node(args) -> int:
    """A node after the leader's: its ranks as child processes; ends with the first that
    ends (a rank that fails takes the node down, and its group is restarted whole)."""
    first = args.node_index * args.local_ranks
    if args.node_index < 1 or first + args.local_ranks > args.world_size:
        raise SystemExit(
            f"--node-index {args.node_index} x --local-ranks {args.local_ranks} is outside "
            f"--world-size {args.world_size} (node 0 is the leader's target worker)"
        )
    processes = [
        subprocess.Popen(
            rank_command(
                first + i,
                args.world_size,
                args.port,
                args.model,
                args.device,
                args.dtype,
                args.threads,
                args.master_addr,
                local_rank=i,
            ),
            preexec_fn=_die_with_parent,
        )
        for i in range(args.local_ranks)
    ]
    from multiprocessing.connection import wait

    sentinels = {_pid_sentinel(p.pid): p for p in processes}
    ended = sentinels[wait(list(sentinels))[0]]
    status = ended.wait()
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
