"""One replica of tests/test_elastic.py's dense-mean check: ``replica_mean`` (DiLoCo's dense
outer exchange: an all_to_all, then an all_gather) over an ``ElasticGroup`` (torchft).

  python tests/elastic_mean_worker.py REPLICA_ID OUT.pt   (env: TORCHFT_LIGHTHOUSE)

Saves this replica's input, the mean it received, the participants and whether torchft let the
step commit."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexdemo.compression.exchange import replica_mean  # noqa: E402
from flexdemo.elastic.group import ElasticGroup  # noqa: E402


def main() -> None:
    replica, out = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = ElasticGroup.create(replica_id=replica, min_replicas=2, backend="gloo", timeout_s=20,
                                state_dict=lambda: {}, load_state_dict=lambda sd: None)
    group.start_step()
    flat = torch.randn(1001, generator=torch.Generator().manual_seed(replica))  # odd: the chunks are padded
    mean, traffic = replica_mean(flat, group, torch.float32)
    torch.save({"input": flat, "mean": mean, "participants": group.size(), "committed": group.commit(),
                "received": traffic.received}, out)
    group.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
