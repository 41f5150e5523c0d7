"""A free TCP port for a rendezvous, shared by the sweep scripts and the end-to-end tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no one listens on now (fixed ports collided when two jobs shared a host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
