"""Helpers for the torchtitan end-to-end tests: run scripts/launch.sh, parse its logs."""

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch.sh"
CONFIGS = REPO / "train_configs"
sys.path.insert(0, str(REPO / "benchmarks"))
from ports import free_port  # noqa: E402  (re-exported for the tests)
from process_tree import kill_tree  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;]*m")

STEP_RE = re.compile(r" - INFO - step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)")
VALIDATE_RE = re.compile(r" - INFO - validate step:\s*(\d+)\s+loss:\s*(\S+)")
XCHG_RE = re.compile(
    r"flexdemo step:\s*(\d+)\s+sent_bytes: (\d+)\s+received_bytes: (\d+)\s+"
    r"sent_bytes_total: (\d+)\s+received_bytes_total: (\d+)"
)
DIGEST_RE = re.compile(r"replica check at step (\d+): \d+ replicas identical \(local (?:param|global copy) digest (\w+)\)")


@dataclass
class Run:
    returncode: int
    output: str  # console: launcher + rank 0 (ranks' lines may interleave; don't parse)
    dump: Path
    log_dir: Path  # torchrun --log-dir: one stdout/stderr file pair per rank

    def rank_lines(self, rank: int) -> list[str]:
        """Rank `rank`'s own output, line-intact (single node: rank == local rank)."""
        lines = []
        for f in sorted(self.log_dir.glob(f"*/attempt_*/{rank}/std*.log")):
            lines += ANSI.sub("", f.read_text(errors="replace")).splitlines()
        return lines

    def losses(self, rank: int = 0) -> dict[int, float]:
        out = {}
        for line in self.rank_lines(rank):
            if m := STEP_RE.search(line):
                out[int(m.group(1))] = float(m.group(2))
        return out

    def validation_losses(self, rank: int = 0) -> dict[int, float]:
        """step -> held-out loss logged by torchtitan's validator."""
        return {int(m.group(1)): float(m.group(2)) for line in self.rank_lines(rank)
                if (m := VALIDATE_RE.search(line))}

    def exchange(self, rank: int) -> dict[int, tuple[int, int, int, int]]:
        out = {}
        for line in self.rank_lines(rank):
            if m := XCHG_RE.search(line):
                out[int(m.group(1))] = tuple(int(g) for g in m.groups()[1:])
        return out

    def digests(self, ranks=range(4)) -> dict[tuple[int, int], str]:
        """(rank, step) -> local param digest logged by the replica check."""
        out = {}
        for rank in ranks:
            for line in self.rank_lines(rank):
                if m := DIGEST_RE.search(line):
                    out[(rank, int(m.group(1)))] = m.group(2)
        return out


def cache_holding(assets: str | Path) -> str:
    """The FLEXDEMO_CACHE under which a launch finds ``assets`` (the session's prebuilt
    stdlib assets, a default_assets_dir build) without building them again."""
    from flexdemo.data.assets import default_assets_dir

    assets = Path(assets)
    assert assets.name == Path(default_assets_dir()).name, f"{assets} is not a default assets build"
    return str(assets.parent)


def launch(config: str | Path, dump: Path, *overrides: str, assets: Path, timeout: float,
           nproc: int = 4, env: dict | None = None, while_running=None, launcher: list[str] | None = None) -> Run:
    """Run scripts/launch.sh (or ``launcher``, which takes the same arguments and environment;
    all ranks' output kept); kill the whole group on timeout.
    ``while_running(run)`` is called every second until the job ends (e.g. to kill a rank)."""
    env = {
        **os.environ,
        "NPROC": str(nproc),
        "LOG_RANK": "0",
        "LOG_DIR": str(dump / "torchrun_logs"),
        "MASTER_PORT": str(free_port()),
        "FLEXDEMO_CACHE": cache_holding(assets),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    cmd = [*(launcher or ["bash", str(LAUNCH)]), str(config), "--job.dump_folder", str(dump),
           "--metrics.disable_color_printing", *overrides]
    run = Run(-1, "", dump, dump / "torchrun_logs")
    with tempfile.TemporaryFile("w+") as console:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=console,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if while_running is not None:
                while_running(run)
            time.sleep(1)
        timed_out = proc.poll() is None
        if timed_out:
            kill_tree(proc.pid)  # torchrun's workers sit in sessions of their own
        proc.wait()
        console.seek(0)
        run.output = console.read()
    if timed_out:
        raise AssertionError(f"launch timed out after {timeout}s:\n{run.output[-5000:]}")
    run.returncode = proc.returncode
    return run


def worker_pid(dump: Path, local_rank: int) -> int | None:
    """The training process of ``local_rank`` in the job writing to ``dump``: the one whose
    stdout is that rank's log under LOG_DIR (launch() sets it; torchrun redirects each worker's
    output there, however the worker was started)."""
    logs = str(dump / "torchrun_logs")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            out = os.readlink(proc / "fd" / "1")
        except OSError:
            continue
        if out.startswith(logs) and Path(out).parent.name == str(local_rank) and out.endswith("stdout.log"):
            return int(proc.name)
    return None


def cpu_model_args():
    """The llama3 model args of the CPU configs' flavor (train_configs/cpu_2x2_flexdemo.toml's)."""
    import tomllib

    from flexdemo.titan.spec import family_spec

    flavor = tomllib.loads((CONFIGS / "cpu_2x2_flexdemo.toml").read_text())["model"]["flavor"]
    return family_spec("llama3").model_args[flavor]


def cpu_model_local_shapes(shard: int, shards: int = 2) -> list[tuple[int, ...]]:
    """Local shapes of the CPU configs' model's parameters on FSDP shard ``shard`` (dim 0, torch.chunk)."""
    import torch
    from torchtitan.models.llama3 import Transformer

    with torch.device("meta"):
        model = Transformer(cpu_model_args())
    out = []
    for p in model.parameters():
        rows = -(-p.shape[0] // shards)
        local_rows = max(0, min(p.shape[0], (shard + 1) * rows) - shard * rows)
        out.append((local_rows, *p.shape[1:]))
    return out


def expected_payload_bytes(shard: int, encoding: str = "sign", shards: int = 2, chunk: int = 64,
                           topk: int = 32) -> int:
    """The payload of this rank's FSDP shard of the CPU configs' model, from the wire format written out
    independently (reference_demo.reference_payload_nbytes)."""
    from reference_demo import reference_payload_nbytes

    return reference_payload_nbytes(list(cpu_model_local_shapes(shard, shards)), topk, chunk, encoding)


def load_dcp(path: Path) -> dict:
    """A DCP checkpoint folder as one plain state dict (via a torch.save file beside it)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def write_own_tokenizer(path: Path, vocab_size: int = 600) -> Path:
    """A user's own tokenizer directory (tokenizer.json + tokenizer_config.json): another
    BPE with a much smaller vocabulary than flexdemo's (a few hundred ids: the training text is
    tiny), so a test can tell which one ran."""
    from flexdemo.data.tokenizer import tokenizer_files, train_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 50, "class A:\n    pass\n" * 50], vocab_size)
    for name, data in tokenizer_files(tok).items():
        (path / name).write_bytes(data)
    return path


def tensorboard_scalars(run):
    """(scalar tags, accumulator) of the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run.dump / "tb").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return set(acc.Tags()["scalars"]), acc


def check_loss_falls(name: str, losses: dict[int, float], drop: float) -> None:
    """A behaviour every machine shares, not a curve recorded on one CPU (whose kernels round
    differently on another ISA): every loss finite, and the mean of the last third of the steps
    at least ``drop`` below the mean of the first third."""
    import math

    steps = sorted(losses)
    assert steps and all(math.isfinite(losses[s]) for s in steps), (name, losses)
    third = max(1, len(steps) // 3)
    first = sum(losses[s] for s in steps[:third]) / third
    last = sum(losses[s] for s in steps[-third:]) / third
    assert last <= first - drop, f"{name}: loss fell from {first:.4f} to {last:.4f}, less than {drop} ({losses})"
