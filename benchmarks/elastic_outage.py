"""Elastic replicas through an outage, measured: tokens/s before, during and after, and the
held-out loss against an uninterrupted run (per-step mode `demo` over torchft).

  python3 benchmarks/elastic_outage.py --out outputs/elastic \
      [--config train_configs/gpu_4gpu_4x1_elastic_flexdemo.toml] [--replicas 4] [--min-replicas 3] \
      [--steps 1000] [--kill-at 300] [--restart-at 500] [--runs outage,uninterrupted]

A Lighthouse (scripts/lighthouse.sh, MIN_REPLICAS = --min-replicas) and one torchrun job per
replica (its own MASTER_PORT, $TORCHFT_LIGHTHOUSE, ``--fault_tolerance.replica_id i``; on a GPU
machine one GPU each through CUDA_VISIBLE_DEVICES). Run "outage": the last replica's process
tree is SIGKILLed once it has logged step --kill-at and started again (same replica id, same
GPU) once replica 0 has logged step --restart-at; run "uninterrupted": the same, untouched. Run
"reference" (optional): the same steps as one torchrun job without torchft
(--reference-config, e.g. gpu_4gpu_4x1_flexdemo), for the cost of the per-step quorum.

Every replica logs every step (``--metrics.log_freq 1``). From the logs:
- how many replicas took part in each of replica 0's steps (its payloads received per payload
  sent, plus one, from the ``flexdemo step:`` lines); K: the first step without the killed
  replica, H: the first with all of them again (the step the restarted replica healed at:
  "healed from a live peer at step H"); the survivors took steps K .. H-1 without it.
- S, the step the kill splits replica 0's steps at, on the survivors' own clock: the first step
  the killed replica never logged (its last logged step + 1) or, if earlier, the first step
  replica 0 logged after the kill's time (its log's timestamps against the driver's clock).
  The step in flight at the kill waits for the dead peer (NCCL: up to the process group's
  timeout) and may still count every replica (its exchange was started with them), so K alone
  would put that stall in "before".
- replica 0's tokens/s per GPU (torchtitan's tps lines) over three windows, as window
  throughput (tokens / seconds = the harmonic mean of the per-step tps): before = steps
  (--warmup, S-1], during = [S, H-1] (the stall included: it is the outage's cost), after =
  (H + --margin, steps]; steps right after a validation (whose time lands in them) are left out;
  the same windows of the uninterrupted run beside them; the stall at the kill (the slowest step
  in [S, K + --margin]) and at the rejoin (the slowest in [H, H + --margin]), each a step and
  its seconds.
- whether the restarted replica's params digest equals replica 0's at every step it logged one
  (the ``flexdemo: replica check at step S: N replicas identical (local param digest D)`` lines, every
  ``replica_check_interval`` steps), and the other survivors' too.
- the held-out loss (torchtitan's validator) at the last step, outage vs uninterrupted.

Writes OUT/results.md (a table) and OUT/results.json (the same numbers); the logs stay under
--work (default OUT/runs) and are packed into OUT/logs.tgz. Runs already in --work are read,
not run again, with --report-only. Exits 1 if a run failed or a check did not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from elastic_cluster import Cluster, last_logged_step  # noqa: E402
from ports import free_port  # noqa: E402
from process_tree import kill_tree  # noqa: E402
from titan_logs import ANSI, RunLog, parse  # noqa: E402

DIGEST = re.compile(r"replica check at step (\d+): (\d+) replicas identical \(local (?:param|global copy) digest (\w+)\)")
HEALED = re.compile(r"elastic replica healed from a live peer at step (\d+)")
QUORUM_CHANGE = re.compile(r"Detected quorum change")


# ---------------------------------------------------------------------------------------- runs

def visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
    return []


def start_replica(cluster: Cluster, args: argparse.Namespace, gpus: list[str], replica: int, name: str) -> None:
    cluster.start(name, args.config, [
        "--fault_tolerance.replica_id", str(replica), "--fault_tolerance.group_size", str(args.replicas),
        "--fault_tolerance.min_replica_size", str(args.min_replicas), "--training.steps", str(args.steps),
        "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--job.dump_folder", str(cluster.folder / "dumps" / name), *shlex.split(args.common)],
        env={"CUDA_VISIBLE_DEVICES": gpus[replica % len(gpus)]} if gpus else None)


def new_cluster(folder: Path, args: argparse.Namespace, gpus: list[str]) -> Cluster:
    if not shutil.which("torchft_lighthouse"):
        raise SystemExit("elastic_outage: torchft_lighthouse is not on PATH (pip install -e \".[ft]\"; "
                         "with pip install --target DIR it is in DIR/bin)")
    env = {"NPROC": "1", **({} if gpus else {"OMP_NUM_THREADS": "1"})}
    if args.quorum_timeout_s:  # torchft's own override of flexdemo's default
        env["TORCHFT_QUORUM_TIMEOUT_SEC"] = str(args.quorum_timeout_s)
    return Cluster(folder, args.min_replicas, env, lighthouse_env={"JOIN_TIMEOUT_MS": str(args.join_timeout_ms)})


def run_elastic(kind: str, args: argparse.Namespace, gpus: list[str]) -> dict:
    """One run ("outage" or "uninterrupted"); returns what the driver saw (exit codes, times)."""
    folder = args.work / kind
    if folder.exists():
        shutil.rmtree(folder)
    victim = f"replica{args.victim}"
    seen: dict = {"kind": kind, "events": {}}
    t0 = time.time()
    deadline = min(t0 + args.timeout, args.deadline)
    cluster = new_cluster(folder, args, gpus)
    try:
        for r in range(args.replicas):
            start_replica(cluster, args, gpus, r, f"replica{r}")
        if kind == "outage":
            cluster.wait_for_step(victim, args.kill_at, deadline)
            cluster.kill(victim)
            killed = time.time()
            seen["events"]["killed_s"] = round(killed - t0, 1)
            seen["events"]["killed_unix"] = round(killed, 3)
            seen["events"]["replica0_step_at_kill"] = last_logged_step(cluster.log("replica0"))
            cluster.wait_for_step("replica0", args.restart_at, deadline)
            start_replica(cluster, args, gpus, args.victim, f"{victim}_restarted")
            seen["events"]["restarted_s"] = round(time.time() - t0, 1)
            seen["events"]["replica0_step_at_restart"] = last_logged_step(cluster.log("replica0"))
        codes = cluster.wait_all(deadline)
    except (RuntimeError, TimeoutError) as e:
        seen["error"] = str(e)
        codes = {n: p.poll() for n, p in cluster.procs.items()}
    finally:
        cluster.close()
    if kind == "outage":
        codes.pop(victim, None)  # killed on purpose
    seen["exit_codes"] = codes
    seen["wall_s"] = round(time.time() - t0, 1)
    (folder / "driver.json").write_text(json.dumps(seen, indent=1))
    return seen


def run_reference(args: argparse.Namespace, gpus: list[str]) -> dict:
    """The same training as one torchrun job over all replicas' GPUs, without torchft."""
    folder = args.work / "reference"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    cmd = ["bash", str(REPO / "scripts" / "launch.sh"), str(args.reference_config),
           "--training.steps", str(args.reference_steps), "--metrics.log_freq", "1",
           "--metrics.disable_color_printing", "--job.dump_folder", str(folder / "dumps"),
           *shlex.split(args.common), *shlex.split(args.reference_flags)]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "LOG_RANK": "0", "NPROC": str(args.replicas)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:args.replicas])
    else:
        env["OMP_NUM_THREADS"] = "1"
    (folder / "replica0.cmd").write_text(" ".join(shlex.quote(c) for c in cmd) + "\n")
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(folder / "replica0.log", "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = p.wait(timeout=max(1.0, min(t0 + args.timeout, args.deadline) - t0))
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        p.wait()
        code = None
    seen = {"kind": "reference", "exit_codes": {"replica0": code}, "wall_s": round(time.time() - t0, 1)}
    (folder / "driver.json").write_text(json.dumps(seen, indent=1))
    return seen


# -------------------------------------------------------------------------------------- report

def digests(log: Path) -> dict[int, tuple[int, str]]:
    if not log.exists():
        return {}
    text = ANSI.sub("", log.read_text(errors="replace"))
    return {int(m[1]): (int(m[2]), m[3]) for m in DIGEST.finditer(text)}


def healed_at(log: Path) -> int | None:
    if not log.exists():
        return None
    m = HEALED.search(ANSI.sub("", log.read_text(errors="replace")))
    return int(m[1]) if m else None


def participants(run: RunLog) -> dict[int, int]:
    """Replicas in each logged step: the payloads received per payload sent, plus one (every
    payload has one size: fixed top-k per chunk)."""
    return {s: round(x.received / x.sent) + 1 for s, x in run.exchange.items() if x.sent}


def window(run: RunLog, lo: int, hi: int, skip: set[int]) -> dict:
    """Replica 0's tokens/s per GPU over logged steps lo < s <= hi, leaving out ``skip``."""
    tps = [run.tps[s] for s in sorted(run.tps) if lo < s <= hi and s not in skip and run.tps[s] > 0]
    if not tps:
        return {"steps": [lo + 1, hi], "n": 0, "tokens_per_s": None, "mean_of_tps": None}
    return {"steps": [lo + 1, hi], "n": len(tps), "tokens_per_s": round(len(tps) / sum(1 / t for t in tps), 1),
            "mean_of_tps": round(sum(tps) / len(tps), 1)}


def step_seconds(run: RunLog, s: int) -> float | None:
    t = run.step_time
    return round(t[s] - t[s - 1], 3) if s in t and s - 1 in t else None


def slowest(run: RunLog, lo: int, hi: int) -> dict | None:
    found = [(step_seconds(run, s), s) for s in range(lo, hi + 1) if step_seconds(run, s) is not None]
    if not found:
        return None
    sec, s = max(found)
    return {"step": s, "seconds": sec}


def kill_split(run: RunLog, victim_last: int, killed_unix: float | None) -> int:
    """The first of replica 0's steps that the kill can have touched, on its own step clock: the
    killed replica's last logged step + 1, or the first step replica 0 logged after the kill's
    time if that is earlier (same host, one clock)."""
    split = victim_last + 1
    if killed_unix is not None and run.t0 is not None:
        after = [s for s, t in run.step_time.items() if run.t0 + t > killed_unix]
        if after:
            split = min(split, min(after))
    return split


def rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def report(args: argparse.Namespace, seen: dict[str, dict]) -> tuple[dict, list[str], bool]:
    R, v = args.replicas, args.victim
    res: dict = {"config": rel(args.config),
                 "replicas": R, "min_replicas": args.min_replicas, "victim": v, "steps": args.steps,
                 "kill_at": args.kill_at, "restart_at": args.restart_at, "warmup": args.warmup,
                 "margin": args.margin, "common": args.common, "runs": {}}
    problems: list[str] = []
    for kind, s in seen.items():
        res["runs"][kind] = s
        bad = {n: c for n, c in s.get("exit_codes", {}).items() if c != 0}
        if bad or s.get("error"):
            problems.append(f"{kind}: exit codes {bad} {s.get('error', '')}".strip())
    out_dir, base_dir = args.work / "outage", args.work / "uninterrupted"
    have_out = (out_dir / "replica0.log").exists()
    have_base = (base_dir / "replica0.log").exists()
    r0 = parse(out_dir / "replica0.log") if have_out else None
    b0 = parse(base_dir / "replica0.log") if have_base else None
    lines: list[str] = []

    def val_skip(run: RunLog | None) -> set[int]:
        return {s + 1 for s in run.validation} if run else set()

    if r0 is not None:
        back = out_dir / f"replica{v}_restarted.log"
        n0 = participants(r0)
        full = min((s for s, n in n0.items() if n == R), default=0)  # start-up: maybe a step or two short
        K = last_logged_step(out_dir / f"replica{v}.log")
        first_short = min((s for s, n in n0.items() if s > full and n < R), default=None)
        H = healed_at(back)
        res["victim_last_logged_step"], res["healed_at"] = K, H
        if first_short is None:
            problems.append("outage: replica 0 never stepped without the killed replica")
            first_short = K + 1
        back_at = min((s for s, n in n0.items() if s > first_short and n == R), default=None)
        if H is None:
            problems.append("outage: the restarted replica never healed (no 'healed from a live peer' line)")
        if back_at is None:
            problems.append("outage: the restarted replica never took part in a step")
            back_at = args.steps + 1
        elif H is not None and H != back_at:
            problems.append(f"outage: healed at step {H} but first took part in step {back_at}")
        res["first_step_without"], res["first_step_back"] = first_short, back_at
        res["survivor_steps_in_outage"] = back_at - first_short
        res["survivor_steps_short"] = sum(1 for s, n in n0.items() if first_short <= s < back_at and n < R)
        split = kill_split(r0, K, seen.get("outage", {}).get("events", {}).get("killed_unix"))
        res["kill_split_step"] = split
        skip = val_skip(r0) | val_skip(b0)
        wins = {"before": (args.warmup, split - 1), "during": (split - 1, back_at - 1),
                "after": (back_at + args.margin, args.steps)}
        res["windows"] = {}
        for name, (lo, hi) in wins.items():
            res["windows"][name] = {"outage": window(r0, lo, hi, skip),
                                    "uninterrupted": window(b0, lo, hi, skip) if b0 else None}
        res["windows_left_out"] = sorted(s for s in skip if s <= args.steps)
        res["stall_at_kill"] = slowest(r0, split, max(split, first_short + args.margin))
        res["stall_at_rejoin"] = slowest(r0, back_at, back_at + args.margin)
        if split - 1 in r0.step_time and back_at in r0.step_time:
            res["outage_wall_s"] = round(r0.step_time[back_at] - r0.step_time[split - 1], 1)
        # digests: the restarted replica (and every survivor) against replica 0, step by step
        d0 = digests(out_dir / "replica0.log")
        checks = {}
        for name in [*(f"replica{r}" for r in range(1, R) if r != v), f"replica{v}", f"replica{v}_restarted"]:
            d = digests(out_dir / f"{name}.log")
            same = [s for s, (_, dig) in d.items() if s in d0 and d0[s][1] == dig]
            differ = [s for s, (_, dig) in d.items() if s in d0 and d0[s][1] != dig]
            missing = [s for s in d if s not in d0]
            checks[name] = {"logged": len(d), "equal": len(same), "differ": differ[:20],
                            "not_in_replica0": missing[:20], "first": min(d, default=None),
                            "last": max(d, default=None)}
        res["digest_checks"] = checks
        rj = checks[f"replica{v}_restarted"]
        res["rejoined_bitwise_equal"] = bool(rj["logged"]) and rj["equal"] == rj["logged"]
        if not res["rejoined_bitwise_equal"]:
            problems.append(f"outage: the rejoined replica's digests: {rj}")
        res["replica0_steps_by_participants"] = {str(n): sum(1 for k in n0.values() if k == n)
                                                 for n in sorted(set(n0.values()))}
        res["quorum_changes"] = len(QUORUM_CHANGE.findall((out_dir / "lighthouse.log").read_text(errors="replace"))) \
            if (out_dir / "lighthouse.log").exists() else None
        res["val_outage"] = r0.validation.get(args.steps)
        res["val_outage_rejoined"] = parse(back).validation.get(args.steps) if back.exists() else None
        res["val_curve_outage"] = {str(s): l for s, l in sorted(r0.validation.items())}
    if b0 is not None:
        d0 = digests(base_dir / "replica0.log")
        nb = participants(b0)
        res["uninterrupted_first_step_all"] = min((s for s, n in nb.items() if n == R), default=None)
        res["uninterrupted_steps_fewer"] = sorted(s for s, n in nb.items() if n < R)[:20]
        equal = True
        for r in range(1, R):
            d = digests(base_dir / f"replica{r}.log")
            equal &= bool(d) and all(d0.get(s, (0, None))[1] == dig for s, (_, dig) in d.items())
        res["uninterrupted_digests_equal"] = equal
        res["val_uninterrupted"] = b0.validation.get(args.steps)
        res["val_curve_uninterrupted"] = {str(s): l for s, l in sorted(b0.validation.items())}
        res["uninterrupted_tokens_per_s"] = window(b0, args.warmup, args.steps, val_skip(b0))
    ref_log = args.work / "reference" / "replica0.log"
    if ref_log.exists():
        ref = parse(ref_log)
        hi = max(ref.tps, default=0)
        res["reference"] = {"config": rel(args.reference_config), "window": window(ref, args.warmup, hi, val_skip(ref))}
        if b0 is not None:
            res["reference"]["uninterrupted_same_window"] = window(b0, args.warmup, hi, val_skip(b0))

    # ---- markdown
    def f(x, fmt="{:,.0f}"):
        return "-" if x is None else fmt.format(x)

    lines.append(f"Elastic outage: {R} replicas (min {args.min_replicas} per step), {args.steps} steps, "
                 f"`{res['config']}`" + (f" {args.common}" if args.common else ""))
    lines.append("")
    if r0 is not None:
        ev = seen.get("outage", {}).get("events", {})
        lines.append(f"Replica {v} killed after it logged step {res['victim_last_logged_step']} (asked at "
                     f"{args.kill_at}), started again when replica 0 had logged step "
                     f"{ev.get('replica0_step_at_restart', '?')} (asked at {args.restart_at}), healed from a live "
                     f"peer at step {res['healed_at']}. Replica 0 stepped without it from step "
                     f"{res['first_step_without']} to {res['first_step_back'] - 1}: "
                     f"{res['survivor_steps_in_outage']} steps"
                     + (f", {res['outage_wall_s']} s from the end of step {res['kill_split_step'] - 1} (the stall "
                        "included)" if 'outage_wall_s' in res else "")
                     + f"; all {R} again from step {res['first_step_back']}.")
        lines.append("")
        lines.append("| replica 0, tokens/s per GPU | before | during | after |")
        lines.append("|---|---:|---:|---:|")
        w = res["windows"]
        lines.append("| steps | " + " | ".join(f"{w[k]['outage']['steps'][0]}-{w[k]['outage']['steps'][1]}"
                                                for k in ("before", "during", "after")) + " |")
        lines.append("| outage run | " + " | ".join(
            f(w[k]["outage"]["tokens_per_s"]) for k in ("before", "during", "after")) + " |")
        if b0 is not None:
            lines.append("| uninterrupted run, same steps | " + " | ".join(
                f(w[k]["uninterrupted"]["tokens_per_s"]) for k in ("before", "during", "after")) + " |")
        lines.append("")
        lines.append("| | value |")
        lines.append("|---|---|")
        sk, sr = res["stall_at_kill"], res["stall_at_rejoin"]
        for what, x in (("at the kill (in 'during')", sk), ("at the rejoin", sr)):
            lines.append(f"| stall {what} | step {x and x['step']}: {f(x and x['seconds'], '{:.2f}')} s |")
        rj = res["digest_checks"][f"replica{v}_restarted"]
        lines.append(f"| rejoined replica's digest = replica 0's | {'yes' if res['rejoined_bitwise_equal'] else 'NO'}: "
                     f"{rj['equal']} of {rj['logged']} checks, steps {rj['first']}-{rj['last']} |")
        lines.append(f"| held-out loss at step {args.steps}, outage run | {f(res['val_outage'], '{:.4f}')} "
                     f"(rejoined replica: {f(res['val_outage_rejoined'], '{:.4f}')}) |")
    if b0 is not None:
        if r0 is None:
            lines.append("| | value |")
            lines.append("|---|---|")
        lines.append(f"| held-out loss at step {args.steps}, uninterrupted | {f(res['val_uninterrupted'], '{:.4f}')} |")
        if r0 is not None and res.get("val_outage") and res.get("val_uninterrupted"):
            res["val_delta_pct"] = round(100 * (res["val_outage"] / res["val_uninterrupted"] - 1), 2)
            lines.append(f"| outage vs uninterrupted | {res['val_delta_pct']:+.2f}% |")
        lines.append(f"| uninterrupted: all {R} from step | {res['uninterrupted_first_step_all']} "
                     f"(digests equal: {'yes' if res['uninterrupted_digests_equal'] else 'NO'}) |")
    if "reference" in res:
        rw = res["reference"]["window"]
        uw = res["reference"].get("uninterrupted_same_window")
        lines.append(f"| without torchft (`{Path(res['reference']['config']).stem}`), steps {rw['steps'][0]}-"
                     f"{rw['steps'][1]} | {f(rw['tokens_per_s'])} tokens/s per GPU"
                     + (f" (elastic uninterrupted, same steps: {f(uw['tokens_per_s'])})" if uw else "") + " |")
    lines.append("")
    if r0 is not None:
        lines.append(f"Windows: replica 0's logged steps, tokens / seconds over the window (S = {res['kill_split_step']}: "
                     "the first step the killed replica never logged, or the first replica 0 logged after the "
                     "kill if earlier; H: the first with all again); before = "
                     f"({args.warmup}, S-1], during = [S, H-1] (the stall at the kill included), after = "
                     f"(H+{args.margin}, {args.steps}]; the step after each validation left out.")
    ok = not problems
    if b0 is not None and not res.get("uninterrupted_digests_equal"):
        problems.append("uninterrupted: replicas' digests differ")
        ok = False
    return res, lines, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "train_configs" / "gpu_4gpu_4x1_elastic_flexdemo.toml")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--min-replicas", type=int, default=3, help="the Lighthouse's and torchft's minimum")
    ap.add_argument("--victim", type=int, default=None, help="replica killed and restarted (default: the last)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--kill-at", type=int, default=300, help="kill once the victim has logged this step")
    ap.add_argument("--restart-at", type=int, default=500, help="restart once replica 0 has logged this step")
    ap.add_argument("--warmup", type=int, default=50, help="steps left out of the 'before' window")
    ap.add_argument("--margin", type=int, default=10,
                    help="steps left out after the rejoin; the stall at the kill is looked for up to K + margin")
    ap.add_argument("--runs", default="outage,uninterrupted", help="comma-separated: outage, uninterrupted, reference")
    ap.add_argument("--common", default="", help="torchtitan flags added to every replica's command line")
    ap.add_argument("--reference-config", type=Path, default=REPO / "train_configs" / "gpu_4gpu_4x1_flexdemo.toml")
    ap.add_argument("--reference-steps", type=int, default=200)
    ap.add_argument("--reference-flags", default="", help="torchtitan flags for the reference run alone")
    ap.add_argument("--join-timeout-ms", type=int, default=5000,
                    help="the Lighthouse's wait for replicas that heartbeat but have not asked yet (keep it below "
                         "[fault_tolerance] process_group_timeout_ms, the quorum's timeout)")
    ap.add_argument("--quorum-timeout-s", type=float, default=0,
                    help="torchft's quorum timeout ($TORCHFT_QUORUM_TIMEOUT_SEC); 0: flexdemo's default, "
                         "max(60, 3 x process_group_timeout_ms)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per run")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds for all runs together: a run is stopped there, and one not started yet with "
                         "less than --min-run-s left is skipped (run it later with --runs; --report-only joins them)")
    ap.add_argument("--min-run-s", type=float, default=120)
    ap.add_argument("--gpus", default="auto", help="'auto' (visible GPUs, one per replica), 'none', or a list 0,1,2,3")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "outputs")) / "elastic")
    ap.add_argument("--work", type=Path, default=None, help="logs (default OUT/runs)")
    ap.add_argument("--report-only", action="store_true", help="read the runs already in --work")
    args = ap.parse_args()
    args.config = args.config.resolve()
    args.reference_config = args.reference_config.resolve()
    args.victim = args.replicas - 1 if args.victim is None else args.victim
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = (args.work or args.out / "runs").resolve()
    if not args.min_replicas * 2 > args.replicas:
        ap.error(f"--min-replicas {args.min_replicas} must be more than half of --replicas {args.replicas}")
    gpus = visible_gpus() if args.gpus == "auto" else [] if args.gpus == "none" else args.gpus.split(",")
    if gpus and len(gpus) < args.replicas:
        ap.error(f"{len(gpus)} GPUs visible for {args.replicas} replicas (one each); pass --gpus none for CPU")
    runs = [r for r in args.runs.split(",") if r]
    unknown = set(runs) - {"outage", "uninterrupted", "reference"}
    if unknown:
        ap.error(f"unknown runs {sorted(unknown)}")
    args.deadline = time.time() + args.deadline_s if args.deadline_s else float("inf")
    seen: dict[str, dict] = {}
    for kind in ("outage", "uninterrupted", "reference"):
        driver = args.work / kind / "driver.json"
        # the uninterrupted run takes about what the outage run took (its stall aside)
        need = 0.9 * seen["outage"]["wall_s"] if kind == "uninterrupted" and "outage" in runs and "outage" in seen \
            else args.min_run_s
        if kind in runs and not args.report_only and args.deadline - time.time() < need:
            print(f"elastic_outage: {kind} run skipped: {args.deadline - time.time():.0f} s left", flush=True)
            if driver.exists():
                seen[kind] = json.loads(driver.read_text())
        elif kind in runs and not args.report_only:
            print(f"elastic_outage: {kind} run ...", flush=True)
            seen[kind] = run_reference(args, gpus) if kind == "reference" else run_elastic(kind, args, gpus)
            print(f"elastic_outage: {kind} run took {seen[kind]['wall_s']} s, exit codes {seen[kind]['exit_codes']}",
                  flush=True)
        elif driver.exists():
            seen[kind] = json.loads(driver.read_text())
    res, lines, ok = report(args, seen)
    res["gpus"] = gpus
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    with tarfile.open(args.out / "logs.tgz", "w:gz") as tar:
        for p in sorted(args.work.rglob("*")):
            if p.is_file() and "dumps" not in p.relative_to(args.work).parts:
                tar.add(p, arcname=str(p.relative_to(args.work)))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
