"""Train every method over a REAL slow link between --nodes "nodes" of one machine, then tabulate
time to loss, bytes and tokens/s.  Root and pyroute2 (pip install pyroute2; no ip/tc binaries).

Each node is a network namespace with one veth to a bridge in a hub namespace (a switch), shaped
with a token bucket (tbf) at --rate each way, and the collectives' sockets (gloo; NCCL with
P2P/SHM/IB off) are bound to it, so the replica traffic crosses the node's link:
  --device gpu: one GPU per node, one replica per node, 1 shard (configs gpu_2gpu_*, their
                replicate degree set to --nodes);
  --device cpu: 2 nodes: two gloo ranks per node, 2 replicas x 2 shards, FSDP inside the node
                (cpu_2x2_*); more nodes: one rank per node.
These kernels have no netem, so latency cannot be emulated: a labelled model adds
(replica-link collectives per step) x --rtt-ms to each measured wall time.

  python3 benchmarks/shaped_link.py --device gpu --rate 1gbit --steps 1000 --flavor small \
      --methods adamw,flexdemo,flexdemo_overlap,diloco,demo_diloco --out outputs/shaped_gpu
  python3 benchmarks/shaped_link.py --device cpu --rate 50mbit --steps 10 --out outputs/shaped_cpu

The table covers every method logged in --out (so two calls can fill one folder) against AdamW's
final validation loss.  A method that is slow on the link (AdamW; at 1B any method) can run only a
few steps there: --link-steps METHOD:N measures its step time on the link for N steps (each step
logged); its loss curve then comes from a full run of the same config off the link
(`METHOD_reference`: run here, or an earlier log given by --reference METHOD:LOG), and its time to
loss is extrapolated from the measured step time (said so in the table).  DiLoCo modes time whole
sync cycles.  Extra torchtitan flags after `--` go to every run.  Namespaces are removed at exit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from process_tree import kill_tree  # noqa: E402
from titan_logs import last_exchange, mean_tokens_per_s, parse, seconds_per_step  # noqa: E402

HUB, BRIDGE = "fdhub", "fdbr"


def node_ns(i: int) -> str:
    return f"fdnode{i}"


def node_addr(i: int) -> str:
    return f"10.77.0.{i + 1}"


CONFIGS = {  # method -> (config per device, extra flags)
    "adamw": ({"gpu": "gpu_2gpu_ddp_adamw", "cpu": "cpu_2x2_hsdp_adamw"}, []),
    "flexdemo": ({"gpu": "gpu_2gpu_flexdemo", "cpu": "cpu_2x2_flexdemo"}, []),
    "flexdemo_sharded": ({"gpu": "gpu_2gpu_flexdemo", "cpu": "cpu_2x2_flexdemo"}, ["--flexdemo.exchange", "sharded"]),
    "flexdemo_overlap": ({"gpu": "gpu_2gpu_flexdemo", "cpu": "cpu_2x2_flexdemo"}, ["--flexdemo.overlap"]),
    "flexdemo_lookahead": ({"gpu": "gpu_2gpu_flexdemo", "cpu": "cpu_2x2_flexdemo"},
                           ["--flexdemo.overlap", "--flexdemo.overlap_lookahead"]),
    "flexdemo_ef": ({"gpu": "gpu_2gpu_flexdemo", "cpu": "cpu_2x2_flexdemo"}, ["--flexdemo.index_coding", "elias_fano"]),
    "diloco": ({"gpu": "gpu_2gpu_diloco", "cpu": "cpu_2x2_diloco"}, []),
    "demo_diloco": ({"gpu": "gpu_2gpu_demo_diloco", "cpu": "cpu_2x2_demo_diloco"}, []),
}


def setup_link(rate: str, nodes: int) -> None:
    from pyroute2 import IPRoute, NetNS, netns

    teardown_link()
    for ns in (HUB, *map(node_ns, range(nodes))):
        netns.create(ns)
    with NetNS(HUB) as hub:
        hub.link("add", ifname=BRIDGE, kind="bridge")
        hub.link("set", index=hub.link_lookup(ifname=BRIDGE)[0], state="up")
    with IPRoute() as ipr:
        for i in range(nodes):
            ipr.link("add", ifname=f"fdlink{i}", kind="veth", peer={"ifname": f"fdport{i}", "net_ns_fd": HUB})
            ipr.link("set", index=ipr.link_lookup(ifname=f"fdlink{i}")[0], net_ns_fd=node_ns(i))
    # Token bucket: `rate` each way of every node's link (its end and the switch's end); a 1 MiB
    # burst lets a 10 Gbit/s bucket refill per tick.
    shape = dict(rate=rate, burst=1024 * 1024, latency="400ms")
    with NetNS(HUB) as hub:
        bridge = hub.link_lookup(ifname=BRIDGE)[0]
        for i in range(nodes):
            port = hub.link_lookup(ifname=f"fdport{i}")[0]
            hub.link("set", index=port, master=bridge, state="up")
            hub.tc("add", "tbf", port, 0x10000, **shape)
    for i in range(nodes):
        with NetNS(node_ns(i)) as n:
            n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
            link = n.link_lookup(ifname=f"fdlink{i}")[0]
            n.addr("add", index=link, address=node_addr(i), prefixlen=24)
            n.link("set", index=link, state="up")
            n.tc("add", "tbf", link, 0x10000, **shape)


def teardown_link() -> None:
    from pyroute2 import netns

    for ns in netns.listnetns():
        if ns == HUB or ns.startswith("fdnode"):
            netns.remove(ns)  # removes its ends of the veths, and with them the pairs


def enter(ns: str):
    from pyroute2 import netns

    return lambda: netns.setns(ns, flags=0)  # flags=0: never create, only join


def ranks_per_node(device: str, nodes: int) -> int:
    return 2 if device == "cpu" and nodes == 2 else 1


def node_env(i: int, nodes: int, device: str, port: int, log_dir: Path) -> dict:
    env = {**os.environ, "NNODES": str(nodes), "NODE_RANK": str(i), "MASTER_ADDR": node_addr(0),
           "MASTER_PORT": str(port), "LOCAL_ADDR": node_addr(i), "IFNAME": f"fdlink{i}", "LOG_RANK": "0",
           "LOG_DIR": str(log_dir / f"node{i}"), "NPROC": str(ranks_per_node(device, nodes))}
    if device == "gpu":
        # One GPU per node; nothing but sockets on the veth between them.
        env.update(CUDA_VISIBLE_DEVICES=str(i), NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1")
    else:
        env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def layout_flags(device: str, nodes: int) -> list[str]:
    """One replica per node: the configs' replicate degree set to the node count (2 nodes on CPU
    keep their 2 x 2 layout)."""
    if ranks_per_node(device, nodes) == 2:
        return []
    return ["--parallelism.data_parallel_replicate_degree", str(nodes), "--parallelism.data_parallel_shard_degree", "1"]


def train(name: str, config: Path, flags: list[str], out: Path, on_link: bool, device: str,
          timeout: float, nodes: int = 2) -> float:
    """One training run (on the link: one launcher per namespace; off it: one launcher on the
    host, same world layout); node 0's console goes to out/<name>.log. Returns its wall seconds."""
    dump = out / "dumps" / name
    args = ["bash", str(REPO / "scripts" / "launch.sh"), str(config), *flags, "--job.dump_folder", str(dump),
            "--metrics.disable_color_printing"]
    port = 29000 + (os.getpid() + len(name) * 7) % 1000
    procs = []
    start = time.time()
    try:
        if on_link:
            for i in reversed(range(nodes)):
                log = open(out / f"{name}_node{i}.log" if i else out / f"{name}.log", "w")
                procs.append(subprocess.Popen(args, cwd=REPO, env=node_env(i, nodes, device, port, out / "logs" / name),
                                              stdout=log, stderr=subprocess.STDOUT, preexec_fn=enter(node_ns(i)),
                                              start_new_session=True))
        else:
            env = {**os.environ, "NPROC": str(nodes * ranks_per_node(device, nodes)), "MASTER_PORT": str(port),
                   "LOG_RANK": "0"}
            procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=open(out / f"{name}.log", "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = start + timeout
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(1)
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one node failed: don't wait for the other to time out
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)  # torchrun's workers sit in sessions of their own
            p.wait()
    codes = [p.returncode for p in procs]
    print(f"=== {name}: exit {codes}, {time.time() - start:.0f} s", flush=True)
    return time.time() - start


def check_interval(config: Path, sync_interval: int) -> int:
    """The config's replica_check_interval rounded up to a multiple of H: DiLoCo replicas are
    identical only right after an outer step (the config check refuses any other interval)."""
    every = tomllib.loads(config.read_text()).get("flexdemo", {}).get("replica_check_interval", 0)
    return -(-every // sync_interval) * sync_interval


def collectives_per_step(method: str, sync_interval: int, log_freq: int, adamw_buckets: int) -> float:
    """Replica-link collectives on the critical path per step (the latency model's count):
    AdamW: its gradient buckets + the stock trainer's token-count all-reduce; flexdemo per-step:
    one all_gather (overlap: still one, counted as not hidden; sharded: two all_to_alls); diloco: all_to_all + all_gather
    per sync, demo_diloco: one all_gather per sync; everyone: the logged loss's two all-reduces
    every log_freq steps."""
    per = {"adamw": adamw_buckets + 1, "flexdemo": 1, "flexdemo_overlap": 1, "flexdemo_lookahead": 1,
           "flexdemo_ef": 1, "flexdemo_sharded": 2,
           "diloco": 2 / sync_interval, "demo_diloco": 1 / sync_interval}[method]
    return per + 2 / log_freq


def first_reach(run, target: float) -> tuple[int, float] | None:
    """(step, seconds after step 1) of the first validation at or below ``target``."""
    for s in sorted(run.validation):
        if run.validation[s] <= target:
            return s, run.validation_time.get(s, math.nan)
    return None


def table(out: Path, args) -> str:
    """Every method with a log in ``out`` (several calls may fill one folder), against AdamW."""
    runs = {m: parse(out / f"{m}.log", m) for m in CONFIGS if (out / f"{m}.log").is_file()}
    if "adamw" not in runs:
        return f"no adamw.log in {out}: nothing to time the methods against\n"
    # A method's loss curve: its full run off the link when it ran only a few steps on it.
    curves = {m: parse(out / f"{m}_reference.log", f"{m}_reference") if (out / f"{m}_reference.log").is_file()
              else run for m, run in runs.items()}
    ref = curves["adamw"]
    if not ref.validation:
        return "no validation loss from AdamW: nothing to compare against\n"
    target = ref.validation[max(ref.validation)]
    rows, results = [], {}
    for m, run in runs.items():
        sps = seconds_per_step(run, args.sync_interval if m.endswith("diloco") else 1)
        coll = collectives_per_step(m, args.sync_interval, args.log_freq, args.adamw_buckets)
        rtt_s = args.rtt_ms / 1000
        curve = curves[m]
        hit = first_reach(curve, target)
        if hit and curve is not run:
            t_hit, how = hit[0] * sps, f"extrapolated: {hit[0]} steps x {sps:.3f} s measured on the link"
        elif hit:
            t_hit, how = hit[1], "measured"
        else:
            t_hit, how = math.nan, "not reached"
        t_model = t_hit + (hit[0] if hit else 0) * coll * rtt_s
        # Not reached: it would take longer than its whole run (same schedule), a lower bound.
        n_curve = max([*curve.loss, *curve.validation], default=0)
        t_whole = n_curve * (sps + coll * rtt_s) if curve is not run else (
            (max(run.step_time) if run.step_time else math.nan) + n_curve * coll * rtt_s)
        bytes_from = curve if last_exchange(curve) else run  # the whole run's bytes
        last_x = last_exchange(bytes_from)
        final_val = curve.validation[max(curve.validation)] if curve.validation else math.nan
        results[m] = dict(steps=max(run.loss, default=0), curve_steps=n_curve,
                          seconds_per_step=sps, validation_loss=final_val,
                          reached_at_step=hit[0] if hit else None, seconds_to_target=t_hit, how=how,
                          seconds_to_target_with_rtt=t_model, collectives_per_step=coll,
                          whole_run_seconds_with_rtt=t_whole,
                          tokens_per_s_per_gpu=mean_tokens_per_s(run),
                          bytes_received_total=last_x.received_total if last_x else None,
                          bytes_modelled=bytes_from.bytes_modelled)
    base = results["adamw"]["seconds_to_target_with_rtt"]  # AdamW's own time to its final loss
    dense = results.get("diloco", {}).get("seconds_to_target_with_rtt", math.nan)
    # diloco not reaching the target in its run: each speed-up over it is at least (its whole run) / t.
    at_least = dense != dense and "diloco" in results
    if at_least:
        dense = results["diloco"]["whole_run_seconds_with_rtt"]
    rows.append(f"target: AdamW's final validation loss {target:.4f} (step {max(ref.validation)}); "
                f"link {args.rate} tbf, modelled RTT {args.rtt_ms} ms\n")
    rows.append("| method | steps on the link / of the curve | val loss (last) | reached at step | s to target, measured | "
                "+ RTT model | speed-up vs AdamW | vs diloco | tokens/s/GPU | s/step | bytes received per rank, "
                "whole run | how |")
    rows.append("|" + "---|" * 12)

    def vs_dense(m, t):
        if t != t or dense != dense or (at_least and m == "diloco"):
            return "-"
        return f"{'>= ' if at_least else ''}{dense / t:.2f}x"

    def num(x, fmt):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    for m, r in results.items():
        t = r["seconds_to_target_with_rtt"]
        rows.append(f"| {m} | {r['steps']} / {r['curve_steps']} | {num(r['validation_loss'], '.4f')} | {num(r['reached_at_step'], 'd')} | "
                    f"{num(r['seconds_to_target'], '.1f')} | {num(t, '.1f')} | {num(base / t, '.1f')}{'x' * (t == t)} | "
                    f"{vs_dense(m, t)} | {num(r['tokens_per_s_per_gpu'], ',.0f')} | "
                    f"{num(r['seconds_per_step'], '.3f')} | {num(r['bytes_received_total'], ',')}"
                    f"{' (modelled)' if r['bytes_modelled'] else ''} | {r['how']} |")
    (out / "results.json").write_text(json.dumps({"target": target, "args": vars(args), "methods": results}, indent=1))
    return "\n".join(rows) + "\n"


def parse_methods(spec: str, steps: int) -> list[tuple[str, int]]:
    """--methods as (method, steps) pairs: "adamw,diloco:2000" -> [("adamw", steps), ("diloco", 2000)].
    A ValueError names the bad part."""
    return [(m, n if n is not None else steps) for m, n in _method_pairs(spec, "--methods", optional=True)]


def _method_pairs(spec: str, flag: str, optional: bool) -> list[tuple[str, int | None]]:
    """"a,b:N" -> [(a, None), (b, N)] with known methods and positive N (required unless optional)."""
    out = []
    for part in spec.split(","):
        method, colon, n = part.partition(":")
        if method not in CONFIGS:
            raise ValueError(f"{flag}: unknown method {method!r}; choose from {list(CONFIGS)}")
        if (colon or not optional) and not (n.isdigit() and int(n) > 0):
            form = "METHOD or METHOD:STEPS" if optional else "METHOD:STEPS"
            raise ValueError(f"{flag}: {part!r}; expected {form} with STEPS a positive integer")
        out.append((method, int(n) if colon else None))
    return out


def parse_link_steps(spec: str) -> dict[str, int]:
    """--link-steps "adamw:20,diloco:65" -> {"adamw": 20, "diloco": 65}."""
    return dict(_method_pairs(spec, "--link-steps", optional=False)) if spec else {}


def check_link_plan(methods: list[tuple[str, int]], link_steps: dict[str, int], references: dict[str, Path]) -> None:
    """Every --link-steps / --reference entry must change a run: a ValueError names the one that
    would be ignored (a method not run, link steps not fewer than its steps, a reference for a
    method that runs all its steps on the link)."""
    steps = dict(methods)
    for m, n in link_steps.items():
        if m not in steps:
            raise ValueError(f"--link-steps {m}:{n}: {m} is not in --methods")
        if n >= steps[m]:
            raise ValueError(f"--link-steps {m}:{n}: not fewer than its {steps[m]} steps (it would run them all)")
    for m in references:
        if m not in link_steps:
            raise ValueError(f"--reference {m}:...: {m} runs all its steps on the link (give --link-steps {m}:N)")


def parse_references(spec: str) -> dict[str, Path]:
    """--reference "adamw:LOG,flexdemo:LOG" -> {method: path}; every path must exist."""
    out = {}
    for part in filter(None, spec.split(",")):
        method, colon, path = part.partition(":")
        if method not in CONFIGS or not colon or not path:
            raise ValueError(f"--reference: {part!r}; expected METHOD:LOG with METHOD one of {list(CONFIGS)}")
        if not Path(path).is_file():
            raise ValueError(f"--reference: {path}: no such file")
        out[method] = Path(path)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--rate", default="1gbit", help="tbf rate each way, e.g. 1gbit, 10gbit, 50mbit")
    ap.add_argument("--nodes", type=int, default=2, help="network namespaces, one replica each (GPU: one GPU each)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--methods", default="adamw,flexdemo,flexdemo_overlap,diloco,demo_diloco",
                    help="comma-separated; METHOD:STEPS gives one method its own run length (its own cosine "
                         "schedule), e.g. diloco:2000 to see when it reaches AdamW's loss")
    ap.add_argument("--link-steps", default="",
                    help="METHOD:N,...: run METHOD only N steps on the link (its step time; every step logged), "
                         "its loss curve from a full run off the link (METHOD_reference)")
    ap.add_argument("--reference", default="",
                    help="METHOD:LOG,...: an earlier off-link log of the same config, steps and flavor, copied in as "
                         "METHOD_reference instead of running it again (only the step time on the link is new)")
    ap.add_argument("--adamw-link-steps", type=int, default=0, help="the same as --link-steps adamw:N")
    ap.add_argument("--adamw-reference", default=None, help="the same as --reference adamw:LOG")
    ap.add_argument("--flavor", default=None, help="model flavor (default: the config's)")
    ap.add_argument("--sync-interval", type=int, default=32, help="H of diloco / demo_diloco")
    ap.add_argument("--val-freq", type=int, default=100)
    ap.add_argument("--log-freq", type=int, default=10)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--adamw-buckets", type=int, default=4,
                    help="AdamW's gradient all-reduces per step, for the RTT model (DDP: grad bytes / 100 MB)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table-only", action="store_true",
                    help="train nothing: tabulate the logs already in --out (e.g. after merging two calls')")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    try:
        methods = parse_methods(args.methods, args.steps)
        link_steps = parse_link_steps(args.link_steps)
        references = parse_references(args.reference)
        if args.adamw_link_steps:
            link_steps.setdefault("adamw", args.adamw_link_steps)
        if args.adamw_reference:
            references.update(parse_references(f"adamw:{args.adamw_reference}"))
        check_link_plan(methods, link_steps, references)
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out or f"outputs/shaped_{args.device}_{args.rate}").absolute()
    if args.table_only:
        print(table(out, args))
        return 0
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces)")
    out.mkdir(parents=True, exist_ok=True)
    common = ["--metrics.log_freq", str(args.log_freq), "--validation.enable", "--validation.freq",
              str(args.val_freq)]
    if args.device == "cpu":  # the CPU configs name no validation set: the embedded corpus's held-out split
        common += ["--validation.dataset", "flexdemo_stdlib_validation", "--validation.local_batch_size", "2",
                   "--validation.seq_len", "128", "--validation.steps", "4"]
    if args.flavor:
        common += ["--model.flavor", args.flavor]
    (out / "command.txt").write_text(" ".join(sys.argv) + "\n")
    # A timeout's SIGTERM must still remove the namespaces (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.nodes < 2:
        ap.error("--nodes must be >= 2")
    common += layout_flags(args.device, args.nodes)
    setup_link(args.rate, args.nodes)
    try:
        for m, method_steps in methods:
            names, flags = CONFIGS[m]
            config = REPO / "train_configs" / f"{names[args.device]}.toml"
            run_flags = [*common, *flags, *extra]
            if m.endswith("diloco"):
                run_flags += ["--flexdemo.sync_interval", str(args.sync_interval), "--flexdemo.replica_check_interval",
                              str(check_interval(config, args.sync_interval))]
            steps = ["--training.steps", str(method_steps)]
            if link_steps.get(m, method_steps) < method_steps:
                if m in references:
                    shutil.copyfile(references[m], out / f"{m}_reference.log")
                else:
                    train(f"{m}_reference", config, [*run_flags, *steps], out, False, args.device, args.timeout,
                          args.nodes)
                # Every step logged: a few steps still give the step time, DiLoCo's in whole cycles.
                steps = ["--training.steps", str(link_steps[m]), "--metrics.log_freq", "1"]
            train(m, config, [*run_flags, *steps], out, True, args.device, args.timeout, args.nodes)
    finally:
        teardown_link()
    summary = table(out, args)
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
