"""The same training on torchtitan 0.2.2 and 0.3.0, given the same start (issue 58 item 4).

With the same config, data and seed the two versions' losses differ from step 1: 0.3.0's llama3
fuses wq/wk/wv into one ``wqkv`` that draws its initial values otherwise (all else initialises
bit-identically, the first batch is the same). So both start here from 0.2.2's initial weights:

1. 0.2.2 (system ``python3``) writes its seed checkpoint (``--checkpoint.create_seed_checkpoint``,
   one process: the model's initial weights, ``step-0``);
2. the 0.3.0 python maps its keys to 0.3.0's (``output`` -> ``lm_head``, ``attention.wq/wk/wv`` ->
   ``attention.qkv_linear.wq/wk/wv``: 0.3.0's FusedQKVLinear saves and loads its ``wqkv`` in the
   stock wq/wk/wv layout through state-dict hooks, which concatenate them per KV group on load;
   every 0.3.0 key is checked to be mapped, with its shape) and writes them as a model-only DCP;
3. every CPU 2 x 2 config trains ``--steps`` steps on both from those weights
   (``--checkpoint.initial_load_path ... --checkpoint.initial_load_model_only``), through
   flexdemo's launcher, and the per-step losses (TensorBoard's float32, else the console's) are
   printed side by side.

    python3 benchmarks/same_training_0_2_0_3.py --python030 /work/venv030/bin/python [--steps 20]
        [--modes demo,off,diloco,demo_diloco] [--work DIR]

Runs one job at a time (4 gloo processes each); ~1 min per job on 2 cores (20 steps: ~5 min).

Measured (2 cores, 20 steps): modes off and diloco equal within float32 rounding (max 9.5e-7);
demo and demo_diloco equal until their first compressed exchange (step 2 / the outer step at 5),
then up to 4e-2 / 1e-2 apart: DeMo compresses each parameter in DCT blocks of ``chunk`` rows, and
0.3.0's fused wqkv interleaves q/k/v rows per KV group (head_dim 16 in debugmodel), so a 64-row
block mixes rows of wq, wk and wv of several heads -- another compression than 0.2.2's separate
wq/wk/wv. With ``--set flexdemo.chunk=16 --set flexdemo.topk=8`` (blocks of one head's rows on
both) demo is bit-equal for 3 steps and then within 1.1e-4 over 8 (sign values amplify rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"
MODES = {"demo": "cpu_2x2_flexdemo", "off": "cpu_2x2_hsdp_adamw", "diloco": "cpu_2x2_diloco",
         "demo_diloco": "cpu_2x2_demo_diloco"}
STEP_RE = re.compile(r"step:\s*(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s*([0-9.]+)")
LOSS_TAGS = ("loss_metrics/global_avg_loss", "loss/global_avg_loss")


def rename_022_to_030(key: str) -> str:
    """A 0.2.2 llama3 state-dict key -> 0.3.0's (its state dict, i.e. what its checkpoints hold)."""
    if key == "output.weight":
        return "lm_head.weight"
    return re.sub(r"^(layers\.\d+\.attention)\.(wq|wk|wv)\.", r"\1.qkv_linear.\2.", key)


def convert(src: str, dst: str, name: str, flavor: str) -> None:
    """0.2.2's DCP model checkpoint ``src`` -> a model-only DCP ``dst`` in 0.3.0's keys (run by
    the 0.3.0 python); refuses unless it fills every key of 0.3.0's model with the same shape."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from flexdemo.titan.v0_3.model import model_spec

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(src, os.path.join(tmp, "sd.pt"))
        old = torch.load(os.path.join(tmp, "sd.pt"), weights_only=False)
    new = {rename_022_to_030(k): v for k, v in old.items()}
    with torch.device("meta"):
        model = model_spec(name, flavor).model.build()
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in new.items()}
    if want != got:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        shapes = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise SystemExit(f"key map incomplete: missing {missing}, unexpected {extra}, other shapes {shapes}")
    dcp.save(new, checkpoint_id=dst, no_dist=True)
    print(f"converted {len(new)} tensors: {src} -> {dst}")


def launch(python: str, config: Path, dump: Path, *overrides: str, nproc: int = 4) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NPROC": str(nproc),
           "MASTER_PORT": str(free_port())}
    cmd = [python, "-m", "flexdemo.titan.launch", "--local-ranks-filter", "0", "--", str(config),
           "--job.dump_folder", str(dump), *overrides]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "console.log").write_text(out)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-4000:]}")
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(dump: Path, console: str) -> tuple[dict[int, float], str]:
    """step -> loss: TensorBoard's float32 scalars where there are any, else the console's."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for events in sorted(dump.rglob("events.out.tfevents.*")):
            acc = EventAccumulator(str(events.parent))
            acc.Reload()
            for tag in LOSS_TAGS:
                if tag in acc.Tags()["scalars"]:
                    return {e.step: e.value for e in acc.Scalars(tag)}, "tensorboard"
    except ImportError:
        pass
    return {int(s): float(v) for s, v in STEP_RE.findall(console)}, "console"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python030", required=False, help="a python with torchtitan 0.3.0 (e.g. /work/venv030/bin/python)")
    ap.add_argument("--python022", default="python3", help="a python with torchtitan 0.2.2 (default: python3)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--work", default=None, help="working folder (default: a fresh temporary one)")
    ap.add_argument("--json", default=None, help="also write the losses here")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="an override for every run on both versions, e.g. --set flexdemo.chunk=16")
    ap.add_argument("--convert", nargs=4, metavar=("SRC", "DST", "NAME", "FLAVOR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.convert:
        convert(*args.convert)
        return 0
    if not args.python030:
        ap.error("--python030 is required")
    modes = [m for m in args.modes.split(",") if m]
    work = Path(args.work or tempfile.mkdtemp(prefix="same_training_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    # 1. 0.2.2's initial weights (every CPU 2x2 config trains the same model: debugmodel_2layer).
    seed022 = work / "seed022"
    first = CONFIGS / f"{MODES[modes[0]]}.toml"
    launch(args.python022, first, seed022, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
           "--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "1",
           nproc=1)
    start022 = seed022 / "checkpoint" / "step-0"
    # 2. the same weights under 0.3.0's keys.
    start030 = work / "seed030"
    subprocess.run([args.python030, __file__, "--convert", str(start022), str(start030), "flexdemo_llama3",
                    "debugmodel_2layer"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    print(f"seed: {start022} (0.2.2), {start030} (0.3.0) [{time.monotonic() - t0:.0f} s]", flush=True)

    # 3. each mode on both from those weights.
    extra = [part for kv in args.set for part in ("--" + kv.partition("=")[0], kv.partition("=")[2])]
    results: dict[str, dict[str, dict[int, float]]] = {}
    sources = set()
    for mode in modes:
        config = CONFIGS / f"{MODES[mode]}.toml"
        results[mode] = {}
        for version, python, start in (("0.2.2", args.python022, start022), ("0.3.0", args.python030, start030)):
            dump = work / version / mode
            out = launch(python, config, dump, "--training.steps", str(args.steps), "--checkpoint.enable",
                         "--checkpoint.interval", str(10 * args.steps), "--checkpoint.initial_load_path", str(start),
                         "--checkpoint.initial_load_model_only", *extra)
            if f"Loading the checkpoint from {start}" not in out:
                raise SystemExit(f"{version} {mode}: did not start from {start} (see {dump}/console.log)")
            results[mode][version], source = losses(dump, out)
            sources.add(source)
            print(f"{mode} on {version}: {len(results[mode][version])} steps [{time.monotonic() - t0:.0f} s]",
                  flush=True)

    print(f"\nlosses from 0.2.2's initial weights ({', '.join(sorted(sources))}; "
          f"CPU, 2 replicas x 2 shards, {args.steps} steps{', ' + ' '.join(args.set) if args.set else ''})")
    head = "step " + "".join(f"| {m:>11} 0.2.2  0.3.0    diff " for m in modes)
    print(head)
    worst = {m: 0.0 for m in modes}
    for step in range(1, args.steps + 1):
        row = f"{step:4d} "
        for m in modes:
            a, b = results[m]["0.2.2"].get(step), results[m]["0.3.0"].get(step)
            if a is None or b is None:
                row += f"| {'missing':>31} "
                continue
            worst[m] = max(worst[m], abs(a - b))
            row += f"| {a:11.6f} {b:9.6f} {b - a:+9.1e} "
        print(row)
    print("max |diff|: " + ", ".join(f"{m} {worst[m]:.1e}" for m in modes))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "losses": results, "max_abs_diff": worst},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
