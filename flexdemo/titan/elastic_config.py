"""The checks of ``[fault_tolerance]`` for flexdemo's elastic replicas (flexdemo.titan.elastic),
run with the rest of the config's before any process group exists."""

from __future__ import annotations

import importlib.util
import os

from flexdemo.elastic.group import LIGHTHOUSE_ENV

ELASTIC_MODES = ("demo", "diloco", "demo_diloco")  # "off" is HSDP: FSDP's all-reduce spans the replicas


def check_elastic(job_config, fail) -> None:
    """``fail(message)`` raises the config error."""
    c, ft, p = job_config.flexdemo, job_config.fault_tolerance, job_config.parallelism
    if c.mode not in ELASTIC_MODES:
        fail(f"fault_tolerance.enable: mode={c.mode!r} cannot run elastic replicas (its replicas are one "
             f"FSDP job); modes that can: {', '.join(ELASTIC_MODES)}")
    if ft.semi_sync_method is not None:
        fail(f"fault_tolerance.semi_sync_method={ft.semi_sync_method!r} is torchtitan's own DiLoCo; flexdemo's "
             "modes bring their own exchange: leave it unset")
    if p.data_parallel_replicate_degree != 1:
        fail(f"fault_tolerance.enable: each replica is its own torchrun job, so "
             f"parallelism.data_parallel_replicate_degree must be 1 (got {p.data_parallel_replicate_degree}); "
             "the replicas are counted by fault_tolerance.group_size")
    if ft.group_size < 1 or not 0 <= ft.replica_id < ft.group_size:
        fail(f"fault_tolerance.group_size={ft.group_size}, replica_id={ft.replica_id}: need group_size >= 1 "
             "(the replicas the run is planned for) and 0 <= replica_id < group_size")
    if not 1 <= ft.min_replica_size <= ft.group_size:
        fail(f"fault_tolerance.min_replica_size={ft.min_replica_size}: need 1 <= it <= group_size={ft.group_size}")
    if ft.process_group not in ("gloo", "nccl"):
        fail(f"fault_tolerance.process_group={ft.process_group!r}; expected 'gloo' or 'nccl'")
    if c.overlap:
        fail("fault_tolerance.enable with flexdemo.overlap: an exchange left in flight cannot cross a change "
             "of the replicas taking part; turn overlap off")
    if importlib.util.find_spec("torchft") is None:
        fail("fault_tolerance.enable needs torchft: pip install -e \".[ft]\"")
    if not os.environ.get("TORCHFT_LIGHTHOUSE"):
        fail(f"fault_tolerance.enable needs ${LIGHTHOUSE_ENV}=http://HOST:PORT, the Lighthouse of "
             "scripts/lighthouse.sh")
