"""Errors of the core, each named for the gRPC status a service maps it to.

The core imports no gRPC; services translate these with one table, so a client always
gets a precise status and message, never a stack trace.
"""


class SpeculativeError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidArgument(SpeculativeError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT)."""


class NotFound(SpeculativeError, LookupError):
    """A named thing (model, session) does not exist (maps to NOT_FOUND)."""


class IncompatibleModels(InvalidArgument):
    """A draft whose vocabulary differs from the target's (maps to INVALID_ARGUMENT)."""


class StaleProposal(SpeculativeError):
    """A proposal extends a committed length the session no longer has (FAILED_PRECONDITION)."""


class ResourceExhausted(SpeculativeError):
    """A memory budget or context window is full (maps to RESOURCE_EXHAUSTED)."""


class WorkerLost(SpeculativeError):
    """A part of this worker is gone (a tensor-parallel rank): it stops; callers go to
    another worker (maps to UNAVAILABLE)."""
