"""The test bind before the workers start (extproc.operations.ports): a port another socket
holds is named with the system's reason, a free one is not, and the test bind releases it."""

from __future__ import annotations

import socket

from extproc.operations.ports import unavailable
from irislab.processes import free_port_range


def test_a_taken_port_is_named_and_a_free_one_is_left_free():
    first = free_port_range(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))
        holder.listen()
        assert unavailable([f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"]) == [f"127.0.0.1:{first} (Address already in use)"]
    assert unavailable([f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"]) == []
    with socket.socket() as again:  # the test bind released the port
        again.bind(("127.0.0.1", first + 1))


def test_an_address_of_no_local_interface_is_named():
    (problem,) = unavailable(["192.0.2.1:50051"])  # TEST-NET-1: on no interface here
    assert problem.startswith("192.0.2.1:50051 (")
