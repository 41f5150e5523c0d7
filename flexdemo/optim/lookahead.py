"""overlap's look-ahead: train on your own share of the update while the rest is in flight.

With ``overlap`` the update exchanged at step t is applied at step t+1, so the gradient of step
t+1 is taken at parameters one update behind. With ``lookahead`` (Psyche's remedy, done here so
that replicas stay bit-identical) each replica, as soon as its step-t exchange has started,
applies its *own* payload decoded alone, ``p -= lr_t * sign(IDCT(own coefficients))`` (the
decode every replica will run on all payloads, on one), after keeping a copy of the parameters
from before it (the *base*). At step t+1 the parameters go back to the base exactly (a copy,
not a subtraction, which would round differently on each replica) and the whole exchanged
update is applied to it as without look-ahead.

So the live parameters differ between replicas by their own look-ahead, and the bases (the
consensus) stay bit-identical. Whatever compares or scores the model across replicas (replica
checks, validation) enters :meth:`LookaheadMixin.consensus`, which puts the base in place for
its duration and re-applies the look-ahead after it, bit for bit. Costs: one copy of the
parameters (4 bytes per parameter in fp32) and one more decode per step.
"""

from __future__ import annotations

import contextlib

import torch

from flexdemo.local import local_tensor as _local

BASE_KEY = "lookahead_base"


class LookaheadMixin:
    """For :class:`flexdemo.optim.demo.DeMo`: its ``lookahead``, ``_pending`` (the exchange in
    flight, with the row this replica sent) and ``_pending_lrs``."""

    lookahead: bool
    _lookahead_on: bool = False  # the live parameters hold base + this replica's look-ahead

    def _lookahead_bases(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = self._trainable()
        for p in params:
            if BASE_KEY not in self.state[p]:
                self.state[p][BASE_KEY] = torch.zeros_like(p)  # like the parameter: DCP saves it
        return [_local(p) for p in params], [_local(self.state[p][BASE_KEY]) for p in params]

    @torch.no_grad()
    def _undo_lookahead(self) -> None:
        """Live parameters := the base, exactly."""
        if self._lookahead_on:
            live, bases = self._lookahead_bases()
            for p, b in zip(live, bases):
                p.copy_(b)
            self._lookahead_on = False

    @torch.no_grad()
    def _apply_lookahead(self) -> None:
        """Base := live parameters; then this replica's own payload of the exchange in flight,
        decoded alone and applied with that step's lr."""
        if self._pending is None:
            return
        live, bases = self._lookahead_bases()
        for p, b in zip(live, bases):
            b.copy_(p)
        comp, own = self.compressor, self._pending.sent_row.unsqueeze(0)
        for b in comp.buckets:
            idx, vals = comp.unpack(b, own)
            comp.decode_sign_update(b, idx, vals, [_local(m.param) for m in b.members], self._pending_lrs[b.group_index])
        self._lookahead_on = True

    def _restore_lookahead(self) -> None:
        """After a checkpoint is loaded (its parameters may be another replica's live ones, DCP
        keeping one copy): this replica's own live parameters again, base + own look-ahead. Runs
        once both the base (optimizer state) and the exchange in flight are in, in either order."""
        loaded = all(BASE_KEY in self.state[p] for p in self._trainable())
        if self._lookahead_on and self._pending is not None and loaded:
            self._undo_lookahead()
            self._apply_lookahead()

    @contextlib.contextmanager
    def consensus(self):
        """The replicas' common parameters (the base) in place of the live ones for the duration;
        the look-ahead is re-applied after, the same bits as before. A no-op without look-ahead."""
        was_on = self._lookahead_on
        self._undo_lookahead()
        try:
            yield
        finally:
            if was_on:
                self._apply_lookahead()
