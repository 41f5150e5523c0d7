"""The planner (flexdemo.plan) against the shaped-link runs on the results page: per run, the
predicted seconds per step next to the measured one, as a markdown table.

  python3 benchmarks/plan_check.py          # print the table
  python3 benchmarks/plan_check.py --write  # and replace it in docs/planner.md, between its markers

Each prediction uses the run's own config (benchmarks/shaped_link.py's CONFIGS), its node count
and link rate, no RTT (tbf shapes bandwidth only; the results page models its RTT apart), and a
compute step taken from the same folder's logs, not fitted: AdamW's step off the link
(``adamw_reference``: the same config over NVLink) where the folder has one, else the DiLoCo
run's steps that carry no replica traffic; the DiLoCo modes' own inner steps for themselves. The
per-step mode adds DeMo's measured optimizer time over AdamW's (flexdemo.plan.evidence).
Measured: the run's seconds per step over whole cycles after warm-up (step 5 or the first sync).

A run predicted before it is made: ``--predict FOLDER --nodes N --gbit B --flavor F --sync-interval H
--gpu H200 --methods M,...`` writes docs/results/FOLDER/prediction.json (the compute step then comes
from the planner's table for that GPU, as a user without logs would get it), to commit before the
run; once the run's folder is on the page, the table shows that prediction beside the logs' one.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from shaped_link import CONFIGS  # noqa: E402

RESULTS = REPO / "docs" / "results"
# The folders issue 37 names (2 nodes small and 1B, 4 nodes small, 1 Gbit/s): (flavor, nodes, Gbit/s).
SETS = {"link_small_1gbit": ("small", 2, 1.0), "link_1b_1gbit": ("1B", 2, 1.0),
        "link_4node_1gbit": ("small", 4, 1.0)}
TOLERANCE = 0.20
WARMUP = 5


@dataclass
class Check:
    folder: str
    method: str
    compute: float
    compute_from: str
    predicted: float
    measured: float
    predicted_bytes: float
    measured_bytes: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def _runs(folder: str) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """(run -> {step: seconds since step 1}, run -> bytes received per rank per step, as logged)
    from the folder's runs.csv."""
    times: dict[str, dict[int, float]] = defaultdict(dict)
    per_step: dict[str, float] = {}
    with open(RESULTS / folder / "runs.csv") as f:
        for r in csv.DictReader(f):
            if r["seconds"]:
                times[r["run"]][int(r["step"])] = float(r["seconds"])
            if r["bytes_received_total"]:
                per_step[r["run"]] = int(r["bytes_received_total"]) / int(r["step"])
    return times, per_step


def quiet_step(times: dict[int, float], cycle: int) -> float:
    """Median per-step time of logged windows that hold no outer sync (cycle 0: any window)."""
    steps = sorted(times)
    per = [(times[b] - times[a]) / (b - a) for a, b in zip(steps, steps[1:]) if a >= 2
           and not (cycle and any(s % cycle == 0 for s in range(a + 1, b + 1)))]
    return statistics.median(per)


def measured_step(times: dict[int, float], cycle: int) -> float:
    """Mean per-step time over whole cycles from step max(cycle, WARMUP) (from step 2 where too few)."""
    cycle = max(cycle, 1)
    for start in (max(cycle, WARMUP), 2):
        steps = [s for s in sorted(times) if s >= start]
        spans = [(b - a, a, b) for a in steps for b in steps if b > a and (b - a) % cycle == 0]
        if spans:
            _, a, b = max(spans)
            return (times[b] - times[a]) / (b - a)
    raise ValueError("no whole cycle logged")


def method_config(method: str, flavor: str, sync_interval: int):
    """The job config a shaped-link method ran on a GPU (benchmarks/shaped_link.py's CONFIGS)."""
    from torchtitan.config import ConfigManager

    configs, flags = CONFIGS[method]
    return ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / f"{configs['gpu']}.toml"),
                                       "--model.flavor", flavor, "--flexdemo.sync_interval", str(sync_interval), *flags])


def checks() -> list[Check]:
    from flexdemo.plan.model import Cluster, Variant, plan_row
    from flexdemo.modes import mode_of

    out = []
    for folder, (flavor, nodes, gbit) in SETS.items():
        res = json.loads((RESULTS / folder / "results.json").read_text())
        (runs, logged), h = _runs(folder), int(res["args"]["sync_interval"])
        if "adamw_reference" in runs:
            adamw, adamw_from = quiet_step(runs["adamw_reference"], 0), "adamw_reference"
        else:
            adamw, adamw_from = quiet_step(runs["diloco"], h), "diloco's inner steps"
        for method, m in res["methods"].items():
            jc = method_config(method, flavor, h)
            diloco = mode_of(jc.flexdemo).outer is not None
            compute, compute_from = (quiet_step(runs[method], h), "its inner steps") if diloco else (adamw, adamw_from)
            row = plan_row(jc, Variant(jc.flexdemo.mode), Cluster(nodes, gbit, 0.0, 1, compute, None, "-"))
            measured = measured_step(runs[method], h if diloco else 1)
            out.append(Check(folder, method, compute, compute_from, row.seconds_per_step, measured,
                             row.bytes_per_rank_per_step, logged[method]))
    return out


def prior_checks() -> list[Check]:
    """Runs predicted before they were made: each docs/results folder with a prediction.json (its
    compute step from the planner's GPU table) and the run's runs.csv; methods the run logged."""
    out = []
    for path in sorted(RESULTS.glob("*/prediction.json")):
        if not (path.parent / "runs.csv").is_file():
            continue
        pred, (runs, logged) = json.loads(path.read_text()), _runs(path.parent.name)
        for method, p in pred["methods"].items():
            if method in runs:
                cycle = pred["sync_interval"] if method.endswith("diloco") else 1
                out.append(Check(f"{path.parent.name} (predicted first)", method, p["compute_step"],
                                 f"{pred['gpu']} table", p["seconds_per_step"], measured_step(runs[method], cycle),
                                 p["bytes_per_rank_per_step"], logged[method]))
    return out


def predict(nodes: int, gbit: float, flavor: str, h: int, gpu: str, methods: list[str]) -> dict:
    """Per method: the planner's seconds and bytes per step, its compute step from ``gpu``'s table."""
    from flexdemo.plan.compute import compute_step
    from flexdemo.plan.model import Cluster, Variant, plan_row

    out = {"nodes": nodes, "link_gbit": gbit, "flavor": flavor, "sync_interval": h, "gpu": gpu,
           "rtt_ms": 0.0, "methods": {}}
    for method in methods:
        jc = method_config(method, flavor, h)
        step = compute_step(jc, gpu)
        row = plan_row(jc, Variant(jc.flexdemo.mode), Cluster(nodes, gbit, 0.0, 1, step.seconds, None, "-"))
        out["methods"][method] = {"seconds_per_step": row.seconds_per_step, "compute_step": step.seconds,
                                  "compute_from": step.how, "bytes_per_rank_per_step": row.bytes_per_rank_per_step}
    return out


def markdown(rows: list[Check]) -> str:
    lines = ["| folder | method | compute step (from) | predicted s/step | measured s/step | error | "
             "bytes/step predicted / logged |", "|---|---|---|---:|---:|---:|---:|"]
    for c in rows:
        flag = "" if abs(c.error) <= TOLERANCE else " **miss**"
        lines.append(f"| {c.folder} | {c.method} | {c.compute:.4f} ({c.compute_from}) | {c.predicted:.4f} | "
                     f"{c.measured:.4f} | {c.error:+.1%}{flag} | {c.predicted_bytes:,.0f} / {c.measured_bytes:,.0f} |")
    return "\n".join(lines)


PAGE = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
BEGIN, END = "<!-- plan-check:begin -->", "<!-- plan-check:end -->"


def page_block(text: str) -> str:
    """The table docs/planner.md shows between its markers (tests/test_plan.py holds it to markdown())."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"docs/planner.md needs one {BEGIN} ... {END} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="replace the table in docs/planner.md")
    ap.add_argument("--predict", metavar="FOLDER", help="write docs/results/FOLDER/prediction.json and stop")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gbit", type=float, default=0.2)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--sync-interval", type=int, default=8)
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--methods", default="adamw,flexdemo,flexdemo_sharded,diloco,demo_diloco")
    args = ap.parse_args()
    if args.predict:
        pred = predict(args.nodes, args.gbit, args.flavor, args.sync_interval, args.gpu,
                       args.methods.split(","))
        path = RESULTS / args.predict / "prediction.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(pred, indent=1) + "\n")
        for m, r in pred["methods"].items():
            print(f"{m}: {r['seconds_per_step']:.4f} s/step, {r['bytes_per_rank_per_step']:,.0f} B/step")
        return 0
    rows = checks() + prior_checks()
    print(markdown(rows))
    if args.write:
        text = PAGE.read_text()
        page_block(text)  # one block there
        head, rest = text.split(BEGIN, 1)
        PAGE.write_text(f"{head}{BEGIN}\n{markdown(rows)}\n{END}{rest.split(END, 1)[1]}")
    within = sum(abs(c.error) <= TOLERANCE for c in rows)
    print(f"\n{within} of {len(rows)} within {TOLERANCE:.0%}")
    return 0 if within == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
