"""Free TCP ports on 127.0.0.1 for servers a test or benchmark is about to start.

Rule: draw at random below the kernel's ephemeral range, where only explicit binds land, never the
same port twice in one process. Why not the kernel's pick (bind to port 0): that comes from the
ephemeral range, the same range every outgoing connection on the machine takes its local port
from, so between this check and the server's bind a client socket of another test or process can
take it (CI saw servers, and an agent's ZMQ bind in the embedded harness, fail that way).
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_PORT_LOW = 20000  # free_port draws from here up to the kernel's ephemeral range
_PORTS_GIVEN: set[int] = set()
_PORT_RNG = random.SystemRandom()  # not the tests' seeded random: parallel processes must not draw alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (module rule)."""
    hi = _ephemeral_low()
    if hi - _PORT_LOW >= 1000:
        for _ in range(200):
            port = _PORT_RNG.randrange(_PORT_LOW, hi)
            if port in _PORTS_GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port
    with socket.socket() as s:  # an unusual port range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
