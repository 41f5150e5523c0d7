"""benchmarks/ports.free_port: a rendezvous port that outgoing connections cannot take first."""

import random
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ports  # noqa: E402


def test_port_is_below_the_ephemeral_range_and_free():
    port = ports.free_port()
    assert ports._LOWEST <= port < ports._ephemeral_start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if it were taken


def test_a_port_someone_listens_on_is_passed_over(monkeypatch):
    busy = ports.free_port()

    def busy_first(self, candidates):
        candidates.remove(busy)
        candidates.insert(0, busy)

    monkeypatch.setattr(random.SystemRandom, "shuffle", busy_first)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        port = ports.free_port()
    assert port != busy
    assert ports._LOWEST <= port < ports._ephemeral_start()
