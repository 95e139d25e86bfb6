"""The draft worker's connections to target workers: one gRPC channel per target address
(gRPC multiplexes all streams over it), what each target serves (asked once), the costs
adaptive calls measured with it per drafter (they seed the next call's policy), and a
target's errors as the draft's caller should see them."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import grpc

from foundation.errors import InvalidArgument
from service_common.security import Tls
from service_common.server import channel
from service_common.status import Unavailable
from specdec.v1 import common_pb2, target_pb2_grpc
from speculative.estimator import MeasuredCosts


class TargetRpcError(grpc.RpcError):
    """A target's error status, passed on with the same code and the target's address
    (service_common.status turns any grpc.RpcError into the caller's status)."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        super().__init__(f"target worker at {address}: {details}")
        self._code = code
        self._details = f"target worker at {address}: {details}"

    @classmethod
    def from_rpc_error(cls, address: str, error: grpc.RpcError) -> TargetRpcError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(address, code, details or code.name)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass(frozen=True)
class TargetInfo:
    """What a target worker serves, as far as drafting cares."""

    model_id: str
    tokenizer_fingerprint: str
    context_length: int | None  # tokens; None = the target did not say
    step_ms: tuple[
        float, ...
    ] = ()  # [w - 1] what the target timed a step of w tokens to cost (empty: not)


class TargetConnections:
    """One channel per target address (gRPC multiplexes all streams over it), each
    target's model info, asked once per address, and the costs adaptive calls measured
    with it, per drafter (they seed the next call's policy)."""

    def __init__(self, tls: Tls | None = None):
        self.tls = tls  # with it, only targets whose certificate the cluster CA signed are reached
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, target_pb2_grpc.TargetServiceStub] = {}
        self._infos: dict[str, TargetInfo] = {}
        self._reached: set[str] = set()  # addresses that answered Info at least once
        self._costs: dict[tuple[str, str], MeasuredCosts] = {}  # (address, drafter) ->

    def costs(self, address: str, drafter: str) -> MeasuredCosts | None:
        with self._lock:
            return self._costs.get((address, drafter))

    def remember_costs(self, address: str, drafter: str, costs: MeasuredCosts) -> None:
        with self._lock:
            self._costs[(address, drafter)] = costs

    def stub(self, address: str) -> target_pb2_grpc.TargetServiceStub:
        with self._lock:
            if address not in self._stubs:
                self._channels[address] = channel(address, self.tls)
                self._stubs[address] = target_pb2_grpc.TargetServiceStub(self._channels[address])
            return self._stubs[address]

    def info(self, address: str, timeout_s: float) -> TargetInfo:
        """The target's model (cached after the first successful Info call)."""
        with self._lock:
            cached = self._infos.get(address)
        if cached is not None:
            return cached
        try:
            response = self.stub(address).Info(common_pb2.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            self._drop_channel_if_never_reached(address)
            raise as_target_error(address, error) from None
        model = response.model
        info = TargetInfo(
            model.model_id,
            model.tokenizer_fingerprint,
            model.context_length or None,
            _step_ms(model.step_ms),
        )
        with self._lock:
            self._infos[address] = info
            self._reached.add(address)
        return info

    def forget(self, address: str) -> None:
        """Drops what was learnt about a target (it may have restarted with another model)."""
        with self._lock:
            self._infos.pop(address, None)
            for key in [key for key in self._costs if key[0] == address]:
                del self._costs[key]

    def _drop_channel_if_never_reached(self, address: str) -> None:
        """Keeps no channel to an address that never answered (a typo must not cost a
        channel for the worker's lifetime); one that did may carry other calls' streams."""
        with self._lock:
            if address in self._reached:
                return
            open_channel = self._channels.pop(address, None)
            self._stubs.pop(address, None)
        if open_channel is not None:
            open_channel.close()

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
            self._infos.clear()
        for open_channel in channels:
            open_channel.close()


def as_target_error(address: str, error: grpc.RpcError) -> Exception:
    """A target's status as the caller should see it; an unreachable target is
    UNAVAILABLE with its address named."""
    if hasattr(error, "code") and error.code() == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"target worker at {address} is unavailable: {error.details()}")
    if hasattr(error, "code") and error.code() == grpc.StatusCode.UNIMPLEMENTED:
        # Another service answered (a draft, an orchestrator): the address is wrong, and
        # UNIMPLEMENTED would claim that this draft lacks Speculate.
        return InvalidArgument(
            f"target.worker_address {address} serves no TargetService: {error.details()}"
        )
    return TargetRpcError.from_rpc_error(address, error)


def _step_ms(reported) -> tuple[float, ...]:
    """The target's step costs, or none where it sent any that are not a positive time."""
    costs = tuple(reported)
    return costs if all(math.isfinite(ms) and ms > 0 for ms in costs) else ()
