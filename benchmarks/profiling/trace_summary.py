"""Where a torchtitan training step's GPU time goes, from a torch.profiler chrome trace
(torchtitan's `--profiling.enable_profiling`: <dump>/profile_traces/iteration_N/rankR_trace.json).

Per profiled step (the CPU's `ProfilerStep#N` spans) it prints: the step's GPU span (first
kernel start to last kernel end of the kernels launched in it), the time at least one kernel runs
(all streams), the idle rest and its largest gaps (with the kernels on either side), the
optimizer's share (kernels launched inside `Optimizer.step#...` and their busy time, and the
optimizer's CPU wall time), and the kernels by total time. Names are shortened to 70 characters.

    python3 benchmarks/profiling/trace_summary.py TRACE.json [TRACE2.json ...] > summary.md
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def spans(events: list[dict], prefix: str) -> list[tuple[str, float, float]]:
    """The CPU's annotations named prefix... (not their GPU-timeline copies)."""
    return sorted((e["name"], e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op")
                  and e.get("name", "").startswith(prefix))


def summarize(path: str, top: int, gaps: int) -> str:
    events = load(path)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")  # Triton: cuLaunchKernel
                and "correlation" in e.get("args", {})}
    steps = spans(events, "ProfilerStep#")
    optim = spans(events, "Optimizer.step#")
    lines = [f"## {path}", ""]
    for name, s0, s1 in steps:
        # A kernel belongs to the step whose CPU span launched it.
        mine = [k for k in kernels if s0 <= launches.get(k.get("args", {}).get("correlation"), -1.0) < s1]
        if not mine:
            continue
        iv = [(k["ts"], k["ts"] + k.get("dur", 0)) for k in mine]
        g0, g1 = min(a for a, _ in iv), max(b for _, b in iv)
        busy = busy_union(iv)
        in_opt = [k for k in mine if any(o0 <= launches.get(k["args"].get("correlation"), -1.0) < o1
                                         for _, o0, o1 in optim)]
        opt_iv = [(k["ts"], k["ts"] + k.get("dur", 0)) for k in in_opt]
        opt_cpu = sum(o1 - o0 for _, o0, o1 in optim if s0 <= o0 < s1)
        lines += [f"### {name}", "",
                  f"- CPU span {(s1 - s0) / 1e3:.2f} ms; GPU span {(g1 - g0) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
                  f"idle {(g1 - g0 - busy) / 1e3:.2f} ms; {len(mine)} kernels",
                  f"- optimizer: {len(in_opt)} kernels, busy {busy_union(opt_iv) / 1e3:.2f} ms"
                  + (f" over a GPU span of {(max(b for _, b in opt_iv) - min(a for a, _ in opt_iv)) / 1e3:.2f} ms"
                     if opt_iv else "") + f"; CPU time in Optimizer.step {opt_cpu / 1e3:.2f} ms", ""]
        order = sorted(mine, key=lambda k: k["ts"])
        holes, end, prev = [], order[0]["ts"], order[0]
        for k in order[1:]:
            if k["ts"] > end:
                holes.append((k["ts"] - end, prev["name"], k["name"]))
            if k["ts"] + k.get("dur", 0) >= end:
                end, prev = k["ts"] + k.get("dur", 0), k
        lines += ["| idle gap ms | after | before |", "|---:|---|---|"]
        lines += [f"| {g / 1e3:.3f} | {a[:70]} | {b[:70]} |" for g, a, b in sorted(holes, reverse=True)[:gaps]]
        by = collections.defaultdict(lambda: [0.0, 0, False])
        opt_ids = {id(k) for k in in_opt}
        for k in mine:
            row = by[k["name"][:70]]
            row[0] += k.get("dur", 0)
            row[1] += 1
            row[2] |= id(k) in opt_ids
        lines += ["", "| kernel | ms | calls | in optimizer |", "|---|---:|---:|---|"]
        lines += [f"| {n} | {v[0] / 1e3:.2f} | {v[1]} | {'yes' if v[2] else ''} |"
                  for n, v in sorted(by.items(), key=lambda x: -x[1][0])[:top]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=25, help="kernels to list per step")
    ap.add_argument("--gaps", type=int, default=10, help="idle gaps to list per step")
    args = ap.parse_args(argv)
    for path in args.traces:
        print(summarize(path, args.top, args.gaps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
