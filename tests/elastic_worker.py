"""One replica of the elastic toy run (tests/test_elastic.py): a small MLP trained by DeMo over
an ``ElasticGroup`` (torchft), one process per replica, its own gloo world of one.

  python tests/elastic_worker.py REPLICA_ID STEPS OUT_JSONL   (env: TORCHFT_LIGHTHOUSE;
                                                             ELASTIC_EXCHANGE: allgather or sharded;
                                                             ELASTIC_START_BARRIER: DIR:N)

Each committed or skipped step writes one JSON line: the step, how many replicas took part,
whether it was applied, and a SHA-256 of the parameters' bytes after it. The replica's data
depend on (replica, step) only, so a rejoined replica draws what it would have drawn.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexdemo.elastic.group import ElasticGroup  # noqa: E402
from flexdemo.optim import DeMo  # noqa: E402


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def wait_for_the_others(barrier: str, replica: int) -> None:
    """Step 1 only once N replicas are ready: torchft's first quorum takes whoever has joined,
    and a replica still importing torch on a loaded machine would join at step 2 by healing.
    A restarted replica finds every file there and goes on at once."""
    folder, n = barrier.rsplit(":", 1)
    open(os.path.join(folder, f"ready{replica}"), "w").close()
    deadline = time.time() + 120
    while len([f for f in os.listdir(folder) if f.startswith("ready")]) < int(n):
        if time.time() > deadline:
            raise SystemExit(f"replica {replica}: the other replicas were not ready within 120 s")
        time.sleep(0.05)


def main() -> None:
    replica, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    pause = float(os.environ.get("ELASTIC_STEP_PAUSE", "0.2"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)  # every replica starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))

    def state_dict():
        return {"model": model.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])

    group = ElasticGroup.create(replica_id=replica, min_replicas=1, backend="gloo", timeout_s=20,
                                state_dict=state_dict, load_state_dict=load_state_dict)
    opt = DeMo(model.parameters(), lr=1e-2, compression_topk=4, compression_chunk=8, replicate_group=group,
               exchange=os.environ.get("ELASTIC_EXCHANGE", "allgather"))
    if os.environ.get("ELASTIC_START_BARRIER"):
        wait_for_the_others(os.environ["ELASTIC_START_BARRIER"], replica)
    with open(out, "a") as log:
        while group.manager.current_step() < steps:
            group.start_step()  # a replica behind the others heals here
            step = group.manager.current_step() + 1
            g = torch.Generator().manual_seed(1000 * replica + step)
            x = torch.randn(16, 32, generator=g)
            loss = (model(x) - x[:, :8]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            applied = group.failed_steps
            opt.step()
            applied = group.failed_steps == applied
            log.write(json.dumps({"step": step, "participants": group.size(), "applied": applied,
                                  "digest": digest(model), "loss": loss.item()}) + "\n")
            log.flush()
            time.sleep(pause)
    group.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
