"""``ElasticGroup``: the replica dimension when replicas come and go, on torchft.

torchft's Lighthouse forms a quorum of replica groups before every step (``start_quorum``);
its process group is reconfigured to exactly the replicas in that quorum, and a replica that
joins behind the others heals from a live peer (the state-dict callbacks, over torchft's HTTP
checkpoint transport) before it computes anything. flexdemo's exchange then runs over that
process group: the mean of each step is over whoever took part. After the exchange
``commit`` asks torchft whether the step may be applied (this replica's collective and
quorum succeeded); a step that may not is skipped here and its payload goes back into the
momentum (the optimizer's part). A replica that saw no failure in that step applies it: a
mid-exchange loss that only some replicas notice leaves them apart, which the replica check
(a digest all_gathered over the quorum) then stops.

Only torchft's all_gather and all_to_all are used (not its all-reduce, whose sum order is
the backend's: flexdemo's means must come out bit-identical on every replica); a failed
collective is reported to the Manager, which turns it into a ``should_commit`` of False,
instead of killing the process.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def default_quorum_timeout_s(timeout_s: float) -> float:
    """How long a replica waits for a quorum ($TORCHFT_QUORUM_TIMEOUT_SEC, torchft's own, wins).
    Longer than a collective's timeout: a survivor can be held that long by a collective with a
    dead peer before it asks, and the others' requests must not expire meanwhile (with the two
    equal, 4 replicas on gloo crashed). In the DiLoCo modes a joining replica waits for the next
    cycle's start: the variable must then exceed one cycle's time."""
    return max(60.0, 3 * timeout_s)


class ElasticJoinError(RuntimeError):
    """This replica could not join the run (the Lighthouse did not answer): one line, exit 2."""


class ElasticGroup:
    """A torchft Manager and its reconfigurable process group: a :class:`flexdemo.replica_group.ReplicaGroup`.

    ``size()`` / ``rank()`` are this step's participants and this replica's place among them;
    they change only at :meth:`start_step`. Collectives are synchronous; a failure is reported to
    torchft (``commit()`` is then False) instead of raised."""

    membership_fixed = False  # the quorum may change between steps

    def __init__(self, manager, pg):
        self.manager, self.pg = manager, pg
        self.failed_steps = 0  # steps whose exchange failed here (not applied)
        # Before the first quorum there is no process group: torch's optimizer-state loading runs
        # one step with zero gradients (lr 0) to create the state, which exchanges nothing here.
        self.joined = False

    @classmethod
    def create(cls, *, replica_id: int, min_replicas: int, backend: str, timeout_s: float,
               state_dict, load_state_dict, quorum_timeout_s: float | None = None) -> "ElasticGroup":
        """One per process, before the optimizer is built (it reads the group). The Lighthouse's
        address comes from ``$TORCHFT_LIGHTHOUSE``; torchrun's store (MASTER_ADDR/PORT) is the
        replica group's own."""
        import torchft  # the optional extra "ft"

        address = os.environ.get("TORCHFT_LIGHTHOUSE")  # torchft's Manager reads it too
        if not address:
            raise ValueError(f"fault_tolerance.enable needs ${LIGHTHOUSE_ENV} (http://HOST:PORT of "
                             "scripts/lighthouse.sh)")
        timeout = timedelta(seconds=timeout_s)
        pg = (torchft.ProcessGroupNCCL if backend == "nccl" else torchft.ProcessGroupGloo)(timeout=timeout)
        try:
            manager = cls._manager(torchft, pg, replica_id, min_replicas, timeout,
                                   quorum_timeout_s or default_quorum_timeout_s(timeout_s), state_dict, load_state_dict)
        except (RuntimeError, TimeoutError) as e:
            if "connect" not in str(e):
                raise
            raise ElasticJoinError(
                f"the Lighthouse at {address} (${LIGHTHOUSE_ENV}) did not answer within "
                f"{timeout_s:g} s (fault_tolerance.process_group_timeout_ms); is scripts/lighthouse.sh running there?"
            ) from e
        return cls(manager, pg)

    @staticmethod
    def _manager(torchft, pg, replica_id, min_replicas, timeout, quorum_timeout_s, state_dict, load_state_dict):
        return torchft.Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_replicas,
            use_async_quorum=False,  # heal before the forward pass: a rejoined replica's first step is exact
            replica_id=f"flexdemo_{replica_id}", timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timeout,
            init_sync=True,  # at step 0 too, every replica takes one replica's parameters
        )

    # -- the step's membership ------------------------------------------------------------------

    def start_step(self) -> None:
        """The quorum for the coming step; a replica behind the others loads a peer's state here."""
        self.manager.start_quorum()
        self.joined = True

    def size(self) -> int:
        return self.manager.num_participants() if self.joined else 1

    def rank(self) -> int:
        r = self.manager.participating_rank()
        return 0 if r is None else r

    def commit(self) -> bool:
        """Whether this step's update may be applied (every collective of the step succeeded)."""
        if not self.joined:
            return False
        ok = self.manager.should_commit()
        self.failed_steps += not ok
        return ok

    # -- collectives ----------------------------------------------------------------------------

    def global_ranks(self) -> list[int]:
        """The members in this job's world: only this rank (the other replicas are other jobs)."""
        return [torch.distributed.get_rank()] if torch.distributed.is_initialized() else [0]

    def wait(self, work, timeout, what) -> None:
        """Nothing is left in flight: every collective here has returned."""

    def gather_objects(self, obj) -> list:
        """torchft's process group has no object collective: this replica's ``obj`` at its rank, None
        at the others'."""
        out = [None] * self.size()
        out[self.rank() if self.joined else 0] = obj
        return out

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, *, timeout=None, what="an exchange",
                   async_op=False):
        """``out[r] = replica r's mine``. On a failure the Manager is told (``commit`` is then
        False) and ``out`` holds this replica's payload in every row: the bytes are never applied."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        if not self.joined:
            out.copy_(mine.unsqueeze(0).expand_as(out))
            return None
        try:
            self.pg.allgather([list(out.unbind(0))], [mine], AllgatherOptions()).wait()
        except Exception as e:  # gloo / NCCL raise different types for a lost peer
            self.manager.report_error(e)
            out.copy_(mine.unsqueeze(0).expand_as(out))
        return None

    def all_to_all(self, out: torch.Tensor, mine: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, *, timeout=None, what="an exchange") -> None:
        """``out``'s part ``r`` = replica r's part ``rank()`` of ``mine`` (dim 0; equal parts, or
        the given sizes). On a failure the Manager is told and ``out`` holds zeros (never applied)."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        if not self.joined:
            out.zero_()
            return
        try:
            self.pg.alltoall_base(out, mine, out_splits or [], in_splits or [], AllToAllOptions()).wait()
        except Exception as e:
            self.manager.report_error(e)
            out.zero_()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
