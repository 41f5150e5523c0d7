"""Updates skipped for non-finite values: who saw them (said alike on every rank), the one counter
of skips in a row (:class:`SkipStreak`, for DeMo's steps and DiLoCo's outer steps alike) and
:class:`RepeatedSkipsError` when they keep happening, and the reset of the inner optimizers' state
after DiLoCo discards a cycle."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexdemo.compression.exchange import NonFiniteError, distributed

NAMES_SHOWN = 3  # parameters named per replica in a message


class RepeatedSkipsError(NonFiniteError):
    """``max_consecutive_skips`` updates in a row were skipped for non-finite values: raised on
    every rank alike, naming the replicas and parameters."""


class SkipStreak:
    """The updates skipped so far and the ones in a row: ``limit`` (``max_consecutive_skips``; 0:
    never) in a row make :meth:`over_limit` true. Every rank records the same skips in the same
    order (the skips are agreed), so all of them stop at the same update."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.in_a_row: list[tuple[int, dict[int, list[str]]]] = []  # (update, replica -> names)

    def skipped(self, at: int, who: dict[int, list[str]]) -> None:
        self.total += 1
        self.in_a_row.append((at, who))

    def applied(self) -> None:
        self.in_a_row = []

    @property
    def over_limit(self) -> bool:
        return bool(self.limit) and len(self.in_a_row) >= self.limit

    def replicas(self) -> list[int]:
        """The replicas that flagged any skip of the current streak."""
        return sorted({r for _, who in self.in_a_row for r in who})


def describe_nonfinite(who: dict[int, list[str]]) -> str:
    """``{replica: parameter names}`` as ``replica 1 (a, b, c and 4 more)``, for messages."""
    parts = []
    for replica, names in sorted(who.items()):
        more = len(names) - NAMES_SHOWN
        shown = ", ".join(names[:NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")
        parts.append(f"replica {replica}" + (f" ({shown})" if names else ""))
    return "; ".join(parts) or "no replica"


def replicas_that_saw_it(names: list[str], each: torch.Tensor, bad: bool, shard_groups,
                         replicate_group) -> dict[int, list[str]]:
    """Replica -> the parameters (of ``names``, flagged in ``each``) that were non-finite there (on
    any of its shards), the same on every rank: the exchange's flags say only that some replica was."""
    mine = [name for name, flagged in zip(names, each.tolist()) if flagged]
    if distributed():
        order = {name: i for i, name in enumerate(names)}
        for group in shard_groups:  # a union per mesh dimension: every shard's names
            mine = sorted({n for theirs in _gather_objects(mine, group) for n in theirs}, key=order.get)
    # (a torchft group has no object collective: there each replica reports only itself)
    flagged = replicate_group.gather_objects((bad, mine))
    return {replica: report[1] for replica, report in enumerate(flagged) if report is not None and report[0]}


@torch.no_grad()
def reset_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Zero every optimizer state tensor in place: Adam/AdamW's fresh state exactly (step 0, zero
    moments; the same keys and shapes, so checkpoints are unchanged)."""
    for opt in optimizers:
        for state in opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    value.zero_()
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    state[key] = type(value)(0)


def _gather_objects(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
