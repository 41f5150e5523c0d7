"""DiLoCo's compressed outer exchange (``compression = "topk"``): the pseudo-gradient
``global - local`` into each entry's error-feedback buffer, top-k per block of it through the
:class:`~flexdemo.compression.compressor.TopkCompressor`, one exchange with this replica's
non-finite flag, then the decoded mean stepped by the outer optimizer. A step that is not
applied (a replica flagged, or torchft did not commit) gives the error feedback back what it
sent; the sharded exchange's dropped coefficients go back too."""

from __future__ import annotations

from typing import Callable

import torch

from flexdemo.compression.exchange import ExchangeTimer, Traffic
from flexdemo.local import local_tensor
from flexdemo.optim.diloco_dense import DENSE_BUCKET_ELEMENTS


def topk_outer_exchange(
    comp, entry_of: dict, bad: bool, decay: float, on_device: Callable, to_state: Callable, step: Callable,
) -> tuple[Traffic, bool | None, ExchangeTimer]:
    """One compressed outer exchange: ``(traffic, skip, timer)`` with skip True (a replica
    flagged: nothing applied), False (applied through ``step(pairs)``), or None (elastic, not
    committed: nothing applied). ``entry_of[id(param)]``: the entry of a bucket member;
    ``on_device(state, like)`` / ``to_state(state, value)``: a state tensor where ``like``
    lives, and back."""
    payloads, sent = [], []
    for b in comp.buckets:
        idx_parts, val_parts = [], []
        for i, m in enumerate(b.members):
            e = entry_of[id(m.param)]
            local = local_tensor(e.param)
            pg = None if bad else on_device(e.global_copy, local) - local  # none non-finite
            acc = on_device(e.error_feedback, local)
            idx, vals = comp.select(b, [acc], [pg], scale=1.0, decay=decay, members=[i])
            to_state(e.error_feedback, acc)
            idx_parts.append(idx)
            val_parts.append(vals)
        sent.append((torch.cat(idx_parts), torch.cat(val_parts)))
        payloads.append(comp.pack(b, *sent[-1]))
    timer = ExchangeTimer(comp.device)
    gathered = comp.exchange(payloads, torch.tensor([int(bad)], dtype=torch.uint8))
    timer = timer.stop()
    committed = comp.commit()  # elastic: whether torchft lets this replica apply it
    if not committed or any(comp.flags(gathered)):  # not applied: error feedback gets back what it sent
        for b, (idx, vals) in zip(comp.buckets, sent):
            for i, m in enumerate(b.members):
                e = entry_of[id(m.param)]
                acc = on_device(e.error_feedback, local_tensor(e.param))
                comp.restore(b, idx, vals, [acc], members=[i])
                to_state(e.error_feedback, acc)
        return comp.last_traffic, (True if committed else None), timer
    pending, size = [], 0  # decoded outer gradients, stepped together up to a dense bucket's size
    for b, (sent_idx, sent_vals) in zip(comp.buckets, sent):
        idx, vals = comp.unpack(b, gathered)
        dropped = comp.dropped(b, idx, sent_idx, sent_vals)  # sharded: back into error feedback
        for i, m in enumerate(b.members):
            e = entry_of[id(m.param)]
            local = local_tensor(e.param)
            pending.append((e, comp.decode_into(b, idx, vals, i, torch.empty_like(local))))
            size += local.numel()
            if size >= DENSE_BUCKET_ELEMENTS:
                step(pending)
                pending, size = [], 0
            if dropped is not None:
                acc = on_device(e.error_feedback, local)
                comp.restore(b, sent_idx, dropped, [acc], members=[i])
                to_state(e.error_feedback, acc)
    if pending:
        step(pending)
    return comp.last_traffic, False, timer
