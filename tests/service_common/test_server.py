"""service_common.server: what every service process does around its gRPC server."""

import gc

import pytest

from service_common.server import freeze_startup_heap


def _walked_by_a_full_collection(obj) -> bool:
    return any(o is obj for o in gc.get_objects())  # the generations a collection walks


def test_what_start_up_built_is_out_of_the_collectors_reach():
    built_at_start_up = [object()]
    assert _walked_by_a_full_collection(built_at_start_up)
    try:
        freeze_startup_heap()
        made_later = [object()]
        assert not _walked_by_a_full_collection(built_at_start_up)
        assert _walked_by_a_full_collection(made_later)
    finally:
        gc.unfreeze()  # this test process goes on creating and dropping models
    assert _walked_by_a_full_collection(built_at_start_up)


def test_a_held_port_is_taken_by_no_other_socket_but_the_server():
    import socket
    from concurrent import futures

    import grpc

    from service_common.server import port_held

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with port_held(f"127.0.0.1:{port}"):
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # what a rank's gloo socket would have done
        server = grpc.server(futures.ThreadPoolExecutor(1))
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    server.stop(None)
