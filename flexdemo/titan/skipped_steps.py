"""Skipped updates, as the optimizer container reports them: a non-finite gradient in mode demo
(a step skipped on every replica), a discarded cycle in the DiLoCo modes (an outer step skipped).
Each is logged and counted (``replica_exchange/skipped_steps``); ``max_consecutive_skips`` of
them in a row stop every rank, at the same step, with an error naming the replicas and
parameters. DiLoCo counts its own outer steps; the per-step count is kept here.

Mixed into FlexOptimizersContainer (optimizer_container.py), whose attributes it reads:
``optimizers``, ``outer``, ``model_parts``, ``replica``, ``step_count``, ``last_step``,
``max_consecutive_skips`` and the skip counters its __init__ sets.
"""

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from flexdemo.local import local_tensor
from flexdemo.optim.diloco import RepeatedSkipsError, describe_nonfinite


class SkipReporting:
    """Logs, counts and (``max_consecutive_skips``) stops on skipped updates."""

    def _report_skipped_step(self) -> None:
        # DeMo learns of a skipped step without a host sync, so it may tell a step or so late
        # (at the run's last step it waits); steps are named by when they ran.
        last = self.last_step is not None and self.step_count == self.last_step
        skipped: dict[int, set[int]] = {}
        for o in self.optimizers:
            if hasattr(o, "pop_skipped_steps"):
                for ago, replicas in o.pop_skipped_steps(wait=last):
                    skipped.setdefault(self.step_count - ago, set()).update(replicas)
            elif getattr(o, "last_step_skipped_by", []):
                skipped.setdefault(self.step_count, set()).update(o.last_step_skipped_by)
        for step, replicas in sorted(skipped.items()):
            self.skipped_steps_total += 1
            logger.warning(f"flexdemo: step {step}'s update skipped on every replica: a non-finite "
                           f"gradient on replica(s) {sorted(replicas)} ({self.skipped_steps_total} skipped so far)")
        self._skips_to_count.update(skipped)
        # After step t every rank knows of every skipped step up to t - 1 (DeMo reads a step's
        # flags when the next one starts), of step t only maybe: counting up to t - 1 makes all
        # ranks stop at the same step (one stopping earlier would leave the others waiting in
        # the next exchange). The run's last step waited for its own flags.
        self._count_consecutive_skips(self.step_count if last else self.step_count - 1)
        if self.outer is not None and self.outer.last_sync_skipped and self.outer.inner_steps == 0:
            self._report_discarded_cycle()

    def _report_discarded_cycle(self) -> None:
        o = self.outer
        logger.warning(
            f"flexdemo: outer step after step {self.step_count} skipped on every replica ({o.skipped_syncs} "
            f"skipped so far, {o.consecutive_skips} in a row): non-finite parameters on "
            f"{describe_nonfinite(o.last_skipped_by)}; every replica restarts from the global copy "
            "with a fresh inner optimizer state"
        )

    def _count_consecutive_skips(self, through: int) -> None:
        for step in range(self._counted_through + 1, through + 1):
            replicas = self._skips_to_count.pop(step, None)
            if replicas is None:
                self._skip_streak = []
            else:
                self._skip_streak.append((step, replicas))
        self._counted_through = max(self._counted_through, through)
        limit = self.max_consecutive_skips
        if limit and len(self._skip_streak) >= limit:
            self._stop_repeated_skips()

    def _stop_repeated_skips(self) -> None:
        """Raise on every rank (all reach this at the same step) naming the replicas that flagged
        the skipped steps and, where this step's gradients are non-finite again, the parameters."""
        first, last = self._skip_streak[0][0], self._skip_streak[-1][0]
        replicas = sorted(set().union(*(r for _, r in self._skip_streak)))
        who = self._nonfinite_gradients()
        now = (f"; at step {self.step_count} non-finite gradients on {describe_nonfinite(who)}" if who
               else f"; step {self.step_count}'s gradients are finite")
        raise RepeatedSkipsError(
            f"flexdemo: {len(self._skip_streak)} steps in a row ({first}..{last}) skipped on every replica "
            f"(max_consecutive_skips = {self.max_consecutive_skips}): a non-finite gradient on replica(s) "
            f"{replicas}{now}; the fault repeats (bad data? a diverging lr?): stopping"
        )

    def _nonfinite_gradients(self) -> dict[int, list[str]]:
        """Replica -> the parameters whose gradient (this step's, still in ``.grad``) is non-finite
        on any of its ranks, gathered from every rank. After gradient clipping one non-finite
        gradient makes all of that replica's non-finite (the clip factor is NaN)."""
        mine = [name for part in self.model_parts for name, p in part.named_parameters()
                if p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all()]
        everyone = [(self.replica, mine)]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (self.replica, mine))
        order = {name: i for i, (name, _) in enumerate(self.model_parts[0].named_parameters())}
        who: dict[int, set[str]] = {}
        for replica, names in everyone:
            if names:
                who.setdefault(replica, set()).update(names)
        return {r: sorted(names, key=lambda n: order.get(n, len(order))) for r, names in who.items()}
