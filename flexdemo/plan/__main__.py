"""``python -m flexdemo.plan CONFIG.toml --nodes N --link-gbit B [--rtt-ms R]
[--step-seconds S | --gpu H100|H200] [--gpus-per-node G] [--section.key value ...]``

Per mode the config could run (and the shipped presets), one line: bytes received per rank per
step (averaged over a DiLoCo cycle), seconds per step, tokens/s per GPU, memory per GPU; then one
recommendation. The model and its sources: flexdemo.plan. Bad input: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

USAGE_EXIT = 2


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m flexdemo.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a flexdemo TOML config (train_configs/)")
    ap.add_argument("--nodes", type=int, required=True, help="nodes, one replica each (>= 2)")
    ap.add_argument("--link-gbit", type=float, required=True, help="each node's link, Gbit/s (0.3: 300 Mbit/s)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round trip between nodes (default 0)")
    step = ap.add_mutually_exclusive_group(required=True)
    step.add_argument("--step-seconds", type=float, help="one training step on one GPU without replica traffic")
    step.add_argument("--gpu", help="H100 or H200: the step from measured runs, and the GPU's memory")
    ap.add_argument("--gpus-per-node", type=int, default=0,
                    help="GPUs per node (default: the config's shard x TP degrees, or 8 where the shard degree is -1)")
    args, overrides = ap.parse_known_args(argv)
    return args, overrides


def fail(msg: str) -> None:
    print(f"flexdemo.plan: {msg}", file=sys.stderr)
    sys.exit(USAGE_EXIT)


def main(argv: list[str] | None = None) -> list[str]:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    if args.nodes < 2:
        fail(f"--nodes must be >= 2 (one replica per node), got {args.nodes}")
    if not args.link_gbit > 0:
        fail(f"--link-gbit must be > 0, got {args.link_gbit}")
    if args.rtt_ms < 0:
        fail(f"--rtt-ms must be >= 0, got {args.rtt_ms}")
    if args.step_seconds is not None and not args.step_seconds > 0:
        fail(f"--step-seconds must be > 0, got {args.step_seconds}")
    from .evidence import GPU_MEMORY

    if args.gpu is not None and args.gpu not in GPU_MEMORY:
        fail(f"unknown --gpu {args.gpu!r} (known: {', '.join(GPU_MEMORY)}); give --step-seconds instead")
    if not os.path.isfile(args.config):
        fail(f"no config file {args.config}")
    bad = [o for o in overrides if o.startswith("-") and not o.startswith("--")]
    if bad:
        fail(f"unknown arguments {bad}")

    from flexdemo.titan import version

    if not version.V0_2:  # its config reader and model shapes are 0.2.2's
        fail(f"the planner reads configs with torchtitan 0.2.2; this Python has torchtitan {version.TORCHTITAN}: "
             "run it from a 0.2.2 environment (the TOML files are the same)")

    from torchtitan.config import ConfigManager

    from flexdemo.titan.config import FlexDemoConfigError

    from .choose import how_to_run, recommend
    from .compute import UnknownComputeStep, compute_step
    from .model import Cluster, plan_rows

    try:
        job_config = ConfigManager().parse_args(["--job.config_file", args.config, *overrides])
    except (ValueError, FileNotFoundError) as e:
        fail(f"config {args.config}: {e}")
    except SystemExit:  # the config parser refused a key or flag and said which, above
        fail(f"config {args.config}: a key or --section.key flag was refused (the parser's message is above)")
    if not hasattr(job_config, "flexdemo"):
        fail(f"{args.config} is not a flexdemo config (no [flexdemo] section)")
    p = job_config.parallelism
    per_replica = p.tensor_parallel_degree * p.pipeline_parallel_degree
    gpus = args.gpus_per_node or (p.data_parallel_shard_degree * per_replica if p.data_parallel_shard_degree > 0
                                  else 8)
    if gpus % per_replica:
        fail(f"--gpus-per-node {gpus} is not a multiple of the TP x PP degrees ({per_replica})")
    if args.gpu is not None:
        try:
            step = compute_step(job_config, args.gpu)
        except UnknownComputeStep as e:
            fail(str(e))
        seconds, how = step.seconds, step.how
    else:
        seconds, how = args.step_seconds, "given (--step-seconds)"
    cluster = Cluster(args.nodes, args.link_gbit, args.rtt_ms, gpus, seconds,
                      GPU_MEMORY.get(args.gpu), args.gpu or "no GPU named: fit not judged")
    try:
        rows, skipped = plan_rows(job_config, cluster)
    except FlexDemoConfigError as e:
        fail(str(e))
    lines = [f"cluster: {args.nodes} nodes x {gpus} GPUs, {args.link_gbit:g} Gbit/s links, RTT {args.rtt_ms:g} ms; "
             f"{job_config.model.name} {job_config.model.flavor}; compute step {seconds:.4f} s ({how})"]
    lines += [r.line() for r in rows] + skipped
    if cluster.device_memory is not None and not any(r.fits for r in rows):
        print("\n".join(lines))
        fail(f"no mode fits {args.gpu}'s memory with this config (memory per GPU above)")
    best, why = recommend(rows)
    lines.append(f"recommended: {best.variant.mode} ({how_to_run(best, args.config, job_config)}) because {why}" if best
                 else f"recommended: none, because {why}")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
