"""Requests whose bytes are not the method's message get INVALID_ARGUMENT naming the
message type and the parse error, instead of gRPC's own INTERNAL "Exception
deserializing request!" (a status the table in docs/api.md reserves for our bugs),
and no stack trace logged per call.

gRPC parses a request before any handler runs, so the parse is wrapped here: a
failure becomes a marker value that the wrapped handler refuses on its first look.
"""

from __future__ import annotations

import grpc


class _Malformed:
    """Stands in for a request that did not parse."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as error:  # noqa: BLE001 - DecodeError, or whatever a deserializer raises
            return _Malformed(error)

    return deserialize


def _refuse(context: grpc.ServicerContext, method: str, malformed: _Malformed):
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request to {method} is not a valid serialized message: {malformed.error}",
    )


def _checked_unary(behavior, method: str):
    def handler(request, context):
        if isinstance(request, _Malformed):
            _refuse(context, method, request)
        return behavior(request, context)

    return handler


def _checked_stream(behavior, method: str):
    def handler(request_iterator, context):
        def requests():
            for request in request_iterator:
                if isinstance(request, _Malformed):
                    _refuse(context, method, request)
                yield request

        return behavior(requests(), context)

    return handler


_FACTORIES = {  # (request_streaming, response_streaming) -> (behavior field, handler factory)
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class MalformedRequests(grpc.ServerInterceptor):
    """Last of a server's interceptors: the others wrap the handler it returns, keep its
    tolerant parse, and see the refusal as the call's end (a slot taken is released)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        field, factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
        wrap = _checked_stream if handler.request_streaming else _checked_unary
        return factory(
            wrap(getattr(handler, field), handler_call_details.method),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
