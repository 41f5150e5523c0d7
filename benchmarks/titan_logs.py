"""Read a torchtitan + flexdemo console log (rank 0's lines) into per-step series.

Shared by summarize_logs.py, shaped_link.py and plot.py. Times are the logger's
timestamps (seconds since the first training step's line), so loss can be put against wall time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"\[rank0\]:\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
STEP = re.compile(r"\[rank0\].* - INFO - step:\s*(\d+)\s+loss:\s*(\S+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
VALID = re.compile(r"\[rank0\].*validate step:\s*(\d+)\s+loss:\s*(\S+)")
XCHG = re.compile(r"\[rank0\].*flexdemo step:\s*(\d+)\s+sent_bytes(?:_modelled)?:\s*(\d+)"
                  r"\s+received_bytes(?:_modelled)?:\s*(\d+)"
                  r"\s+sent_bytes_total(?:_modelled)?:\s*(\d+)\s+received_bytes_total(?:_modelled)?:\s*(\d+)"
                  r".*?optimizer_step_ms:\s*([\d.]+)(?:\s+exchange_ms:\s*([\d.]+))?")
BATCH = re.compile(r"\[rank0\].*global batch size (\d+), .*?sequence length (\d+)(?:, total steps (\d+))?")
# what the run read (flexdemo's corpora): the training corpus's sha256 and the held-out windows' digest
CORPUS = re.compile(r"\[rank0\].*corpus_sha256=([0-9a-f]+)")
HELDOUT = re.compile(r"\[rank0\].*heldout_digest=([0-9a-f]+)")
# the GPU model it ran on: two cards' kernels part one seed's trajectories (results 11)
CARD = re.compile(r"\[rank0\].*CUDA capacity: (.+?) with [\d.]+GiB memory")


@dataclass
class Exchange:
    sent: int
    received: int
    received_total: int
    optimizer_step_ms: float
    exchange_ms: float | None


@dataclass
class RunLog:
    name: str
    tokens_per_step: int | None = None  # global batch x sequence length
    steps_planned: int | None = None  # the run's training.steps, as the trainer logs it
    loss: dict[int, float] = field(default_factory=dict)
    tps: dict[int, float] = field(default_factory=dict)  # tokens/s per GPU, as torchtitan logs it
    memory_gib: dict[int, float] = field(default_factory=dict)
    step_time: dict[int, float] = field(default_factory=dict)  # seconds after step 1's line
    t0: float | None = None  # the epoch time (local clock) of step_time's zero
    validation: dict[int, float] = field(default_factory=dict)
    validation_time: dict[int, float] = field(default_factory=dict)
    exchange: dict[int, Exchange] = field(default_factory=dict)
    bytes_modelled: bool = False
    corpus_sha256: str = ""  # "" where the log does not say (a torchtitan dataset, or logs before it did)
    heldout_digest: str = ""
    card: str = ""  # "" where the log does not say (a CPU run)


def _stamp(line: str) -> float | None:
    m = STAMP.search(line)
    return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def parse(path: str | Path, name: str | None = None) -> RunLog:
    path = Path(path)
    run = RunLog(name or path.stem)
    times, vtimes = {}, {}
    for raw in path.read_text(errors="replace").splitlines():
        line = ANSI.sub("", raw)
        if m := VALID.search(line):
            run.validation[int(m[1])] = float(m[2])
            vtimes[int(m[1])] = _stamp(line)
        elif m := STEP.search(line):
            s = int(m[1])
            run.loss[s], run.memory_gib[s] = float(m[2]), float(m[3])
            run.tps[s] = float(m[4].replace(",", ""))
            times[s] = _stamp(line)
        elif m := XCHG.search(line):
            run.exchange[int(m[1])] = Exchange(int(m[2]), int(m[3]), int(m[5]), float(m[6]),
                                               float(m[7]) if m[7] else None)
            run.bytes_modelled = run.bytes_modelled or "modelled" in line
        elif (m := BATCH.search(line)) and run.tokens_per_step is None:
            run.tokens_per_step = int(m[1]) * int(m[2])
            run.steps_planned = int(m[3]) if m[3] else None
        elif m := CORPUS.search(line):
            run.corpus_sha256 = run.corpus_sha256 or m[1]
        elif m := HELDOUT.search(line):
            run.heldout_digest = run.heldout_digest or m[1]
        elif m := CARD.search(line):
            run.card = run.card or m[1]
    t0 = times.get(min(times)) if times else None
    if t0 is not None:
        run.t0 = t0
        run.step_time = {s: t - t0 for s, t in times.items() if t is not None}
        run.validation_time = {s: t - t0 for s, t in vtimes.items() if t is not None}
    return run


def seconds_per_step(run: RunLog, cycle: int = 1) -> float:
    """Mean wall time of one step after the first (compile, warm-up), validation included, over
    the widest span of logged steps that is a whole number of ``cycle``-step cycles (DiLoCo: its
    sync interval, so the span holds as many outer steps as it has cycles); nan if none is.
    With cycles, the span starts at step ``cycle`` or later: the first outer step compiles its
    own kernels (12 s of a 40-step run at the small flavor), a cost paid once per run."""
    # Two logged steps span whole cycles when they agree modulo the cycle: the widest span of
    # each residue class is its first and last step; the widest of those wins (ties: earliest).
    by_residue: dict[int, list[int]] = {}
    for s in sorted(s for s in run.step_time if s >= cycle):
        by_residue.setdefault(s % cycle, []).append(s)
    spans = [(ss[-1] - ss[0], -ss[0]) for ss in by_residue.values() if len(ss) > 1]
    if not spans:
        return float("nan")
    width, neg_first = max(spans)
    first, last = -neg_first, -neg_first + width
    return (run.step_time[last] - run.step_time[first]) / (last - first)


def last_exchange(run: RunLog) -> Exchange | None:
    """The last logged exchange line (its totals cover the whole run so far), or None."""
    return run.exchange[max(run.exchange)] if run.exchange else None


def mean_tokens_per_s(run: RunLog) -> float:
    """Mean of torchtitan's logged tokens/s per GPU after the first step (compile, warm-up)."""
    tps = [t for s, t in run.tps.items() if s > 1]
    return sum(tps) / len(tps) if tps else float("nan")
