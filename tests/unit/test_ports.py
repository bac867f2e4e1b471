"""A port another process holds is refused in words, before and at gRPC's bind; a free one is not."""

import errno
import socket
from concurrent import futures

import grpc
import pytest

from common import security
from common.grpc_util import SERVER_OPTIONS, ReservedPort, check_ports_free


def free_port_number() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_another_process_listens_on_is_named_with_its_flag(held_port):
    with pytest.raises(ValueError, match=rf"^port {held_port} is in use on 127.0.0.1 \(--metrics-port\)$"):
        check_ports_free("127.0.0.1", {"--port": 0, "--metrics-port": held_port})


def test_free_ports_and_any_port_pass():
    check_ports_free("127.0.0.1", {"--port": free_port_number(), "--metrics-port": None, "--http-port": 0})


def test_a_port_left_in_time_wait_is_free_as_it_is_for_grpc():
    # A restarted process rebinds its old port while connections it closed are still in TIME_WAIT.
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener does
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = listener.accept()
            conn.close()  # the server's side closes first: its end of the port goes to TIME_WAIT
            client.recv(1)
    check_ports_free("127.0.0.1", {"--port": port})
    server = grpc.server(futures.ThreadPoolExecutor(1), options=SERVER_OPTIONS)
    assert security.add_port(server, f"127.0.0.1:{port}", None) == port


def test_a_reserved_port_is_refused_to_others_and_bound_by_its_grpc_server():
    # The launcher holds a scheduler's port from before its workers load until the scheduler binds it.
    with ReservedPort() as reserved:
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", reserved.port))
        assert refused.value.errno == errno.EADDRINUSE
        check_ports_free("127.0.0.1", {"--port": reserved.port})  # the scheduler's own check passes
        server = grpc.server(futures.ThreadPoolExecutor(1), options=SERVER_OPTIONS)
        assert security.add_port(server, f"127.0.0.1:{reserved.port}", None) == reserved.port
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{reserved.port}") as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
        finally:
            server.stop(None)


def test_a_second_grpc_server_cannot_share_a_port():
    # gRPC's default SO_REUSEPORT would let it bind and take half of the first one's connections.
    first = grpc.server(futures.ThreadPoolExecutor(1), options=SERVER_OPTIONS)
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        second = grpc.server(futures.ThreadPoolExecutor(1), options=SERVER_OPTIONS)
        with pytest.raises(RuntimeError):
            second.add_insecure_port(f"127.0.0.1:{port}")
        with pytest.raises(ValueError, match=f"port {port} is in use"):
            security.add_port(second, f"127.0.0.1:{port}", None)
    finally:
        first.stop(None)


def test_a_host_that_is_not_this_machines_is_named():
    with pytest.raises(ValueError, match="--host 192.0.2.1: not an address of this machine"):
        check_ports_free("192.0.2.1", {"--port": free_port_number()})
