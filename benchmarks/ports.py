"""A free TCP port for a rendezvous, shared by the sweep scripts and the end-to-end tests."""

from __future__ import annotations

import random
import socket

# Ports handed out to outgoing connections (gloo opens many): a rendezvous port taken from this
# range can be grabbed by another job's connection between being picked and being listened on
# (CI saw EADDRINUSE so). Below it only listeners bind, and free_port checks for one.
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000


def _ephemeral_start() -> int:
    try:
        with open(_EPHEMERAL) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port no one listens on now, outside the ephemeral range (fixed ports collided when two
    jobs shared a host); falls back to one the kernel picks if that range is too narrow."""
    top = _ephemeral_start()
    candidates = list(range(_LOWEST, top))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
