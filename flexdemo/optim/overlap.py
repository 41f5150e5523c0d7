"""overlap's exchange in flight: applied at the next step, and carried through a checkpoint.

With ``overlap`` the all_gather of step t is started and left in flight; :meth:`finish_pending`
waits for it and applies its update at the start of step t+1 (or at the run's last step). A
checkpoint taken in between saves the gathered bytes and the lrs they are applied with, in
fixed shapes, so that a resumed run applies the same update (:meth:`pending_state`,
:meth:`load_pending_state`).
"""

from __future__ import annotations

import torch

from flexdemo.compression.compressor import StartedExchange


class OverlapMixin:
    """For :class:`flexdemo.optim.demo.DeMo`: its ``_pending`` exchange (with ``_pending_lrs``
    and ``_pending_sent``), ``_finish``, ``_settle`` and the look-ahead's undo/restore."""

    @torch.no_grad()
    def finish_pending(self) -> None:
        """overlap: wait for the exchange in flight and apply its update now."""
        self._undo_lookahead()  # the update applies to the replicas' common parameters
        if self._pending is not None:
            gathered = self._pending.result()
            self._waited_seconds = self._pending.waited_seconds
            pending, self._pending = self._pending, None
            self._finish(gathered, self._pending_lrs, self._pending_sent, flags=pending.flags)
            # This step's encode reads the momentum next. On CUDA the flags were copied as soon
            # as the exchange landed (a side stream), so this waits for that copy only.
            self._settle()
            del pending

    def pending_state(self) -> dict[str, torch.Tensor]:
        """overlap: the exchange in flight (waited for), to checkpoint with fixed shapes:
        ``pending`` (0/1), every replica's ``bytes``, and the ``lrs`` (one per param group)
        its update is applied with."""
        groups = len(self.param_groups)
        size = self.replicate_group.size() * self.compressor.nbytes
        if self._pending is not None and self.nonfinite == "skip" and any(self.compressor.flags(self._pending.result())):
            self.finish_pending()  # a skipped update: resolve it now (restores the momentum), nothing to carry
        if self._pending is None:
            out = {"pending": torch.zeros(1, dtype=torch.int64), "bytes": torch.zeros(size, dtype=torch.uint8),
                   "lrs": torch.zeros(groups, dtype=torch.float64)}
        else:
            out = {"pending": torch.ones(1, dtype=torch.int64), "bytes": self._pending.result().reshape(-1).cpu(),
                   "lrs": torch.tensor(self._pending_lrs, dtype=torch.float64)}
        if self.lookahead:  # whether the saved parameters hold a look-ahead (the next step goes back to the base)
            out["lookahead"] = torch.tensor([int(self._lookahead_on)], dtype=torch.int64)
        return out

    def load_pending_state(self, state: dict[str, torch.Tensor]) -> None:
        self._lookahead_on = self.lookahead and bool(int(state["lookahead"].item()))  # key only with lookahead
        if not int(state["pending"].item()):
            self._pending = None
            return
        gathered = state["bytes"].to(self.compressor.device).view(self.replicate_group.size(), self.compressor.nbytes)
        me = self.replicate_group.rank()
        self._pending = StartedExchange(gathered, None, sent_row=gathered[me])
        self._pending_lrs = state["lrs"].tolist()
        self._restore_lookahead()
        self._pending_sent = None  # a carried exchange is applied, or (nonfinite="stop") raises
