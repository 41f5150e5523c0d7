"""torchrun worker for test_titan_collectives.py: which collectives one training step issues.

Builds torchtitan's Trainer (or flexdemo's FlexTrainer) on CPU for a [flexdemo] mode, runs
a few steps, and records every c10d collective of the steps RECORD_STEPS with a dispatch
mode, keeping the process group's ranks. Prints one line per recorded collective of rank 0:
``COLLECTIVE <step> <op> <ranks>``. Environment: TRAINER (flex|stock), ARGS (config),
RECORD_STEPS (e.g. 3,4).
"""

import json
import os
import shlex

from flexdemo.titan import cpu_shim

cpu_shim.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

from flexdemo.titan.entry import FlexTrainer  # noqa: E402

RECORD_STEPS = [int(s) for s in os.environ.get("RECORD_STEPS", "3").split(",")]


def _group_ranks(value):
    """Ranks of a process group given as an object or (functional collectives) by name."""
    if isinstance(value, str):
        try:
            value = dist.distributed_c10d._resolve_process_group(value)
        except Exception:
            return None
    if isinstance(value, torch.ScriptObject):  # c10d ops carry the group boxed
        try:
            value = dist.ProcessGroup.unbox(value)
        except Exception:
            return None
    if isinstance(value, dist.ProcessGroup):
        return dist.get_process_group_ranks(value)
    return None


class CollectiveRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if "c10d" in name and "wait" not in name and "wrap_tensor" not in name:
            ranks = next((r for r in map(_group_ranks, [*args, *kwargs.values()]) if r is not None), None)
            self.seen.append((name, ranks))
        return func(*args, **kwargs)


def main():
    args = shlex.split(os.environ["ARGS"])
    job_config = ConfigManager().parse_args(args)
    cls = FlexTrainer if os.environ.get("TRAINER", "flex") == "flex" else Trainer
    trainer = cls(job_config)
    data = trainer.batch_generator(trainer.dataloader)
    recorded = {}
    for step in range(1, max(RECORD_STEPS) + 1):
        trainer.step = step
        if step in RECORD_STEPS:
            with CollectiveRecorder() as recorder:
                trainer.train_step(data)
            recorded[step] = recorder.seen
        else:
            trainer.train_step(data)
    if dist.get_rank() == 0:
        for step, seen in recorded.items():
            for name, ranks in seen:
                print(f"COLLECTIVE {step} {name} {json.dumps(ranks)}", flush=True)
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # An exception still exits 1 the usual way; a normal finish skips the gloo teardown abort.
    cpu_shim.exit_without_teardown(main() or 0)
