"""Core errors -> gRPC statuses, in one table, so a client always gets a precise status
and message and never a stack trace; the worker logs unexpected errors and keeps serving.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from foundation.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpeculativeError,
    StaleProposal,
    WorkerLost,
)

log = logging.getLogger(__name__)


class AlreadyExists(SpeculativeError):
    """A session id that is already in use (ALREADY_EXISTS)."""


class Unavailable(SpeculativeError):
    """A worker or dependency cannot be reached (UNAVAILABLE)."""


class FailedPrecondition(SpeculativeError):
    """The request is valid but the state does not allow it now (FAILED_PRECONDITION)."""


class SessionBusy(FailedPrecondition):
    """Another call holds the session: the orchestrator's Generate answers
    FAILED_PRECONDITION; the draft worker, whose calls wait a while first, ABORTED."""


STATUS_OF_ERROR = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (StaleProposal, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (WorkerLost, grpc.StatusCode.UNAVAILABLE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
]


def status_of(error: SpeculativeError) -> grpc.StatusCode:
    for error_class, code in STATUS_OF_ERROR:
        if isinstance(error, error_class):
            return code
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, method: str, error: Exception):
    if isinstance(error, SpeculativeError):
        context.abort(status_of(error), str(error))
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        # A downstream worker's status (e.g. the target's, seen by the draft) passes on.
        context.abort(error.code(), f"downstream: {error.details()}")
    log.exception("unexpected error in %s", method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the worker's log")


def rpc_errors(handler):
    """Decorates a servicer method (unary or streaming response) with the mapping."""
    method = handler.__name__
    if inspect.isgeneratorfunction(handler):

        @functools.wraps(handler)
        def streaming(self, request, context):
            try:
                yield from handler(self, request, context)
            except Exception as error:  # noqa: BLE001 - mapped to a status, logged if unexpected
                if not context.is_active():  # the caller cancelled or its deadline passed
                    log.debug("%s ended after its caller left: %r", method, error)
                    return
                if context.code() is None:
                    _abort(context, method, error)
                raise

        return streaming

    @functools.wraps(handler)
    def unary(self, request, context):
        try:
            return handler(self, request, context)
        except Exception as error:  # noqa: BLE001
            if context.code() is None:
                _abort(context, method, error)
            raise

    return unary
