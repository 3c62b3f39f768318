"""The lab's ports: picked before the processes that bind them have started, so one process
never hands out a port twice (the kernel offers a closed port again soon enough to collide)."""

from __future__ import annotations

from irislab.processes import free_port, free_port_range


def test_a_process_never_hands_out_a_port_twice():
    picked = [free_port() for _ in range(2000)]
    first = free_port_range(3)
    assert len(set(picked)) == len(picked)
    assert not set(picked) & {first, first + 1, first + 2}
