"""How a run's replicas stay in step, as its optimizers container sees it: one object per run,
made once from the mode's build (flexdemo.modes ``Built.outer``) and asked at every step by the
container, the byte meter, the checkpoint, elastic healing and the replica check. None of them
branches on the mode or on whether there is an outer step.

* :class:`EveryStep` (off, demo): whatever crosses the replicas does so inside each optimizer
  step: HSDP's all-reduce (bytes modelled), or DeMo's exchange (bytes counted by DeMo).
* :class:`OuterCycle` (diloco, demo_diloco): the inner optimizers train each replica alone; the
  DiLoCo outer step runs every ``sync_interval`` steps.
"""

from __future__ import annotations

from typing import Any

from torchtitan.tools.logging import logger

from flexdemo.optim.diloco import DiLoCo
from flexdemo.optim.nonfinite import describe_nonfinite
from flexdemo.replica_check import shared_tensors

from .meters import SkippedSteps


class EveryStep:
    """Modes without an outer step: the optimizers' own step is the whole exchange."""

    checked = "param"  # what the replica check hashes
    compressor = None  # an exchange of its own besides the optimizers' (they own theirs)
    settings = None  # settings of its own the replicas must agree on (the optimizers' are theirs)
    last_sync_seconds = None
    at_cycle_start = True  # an elastic quorum may form before any step

    def __init__(self, optimizers: list, skips: SkippedSteps, modelled_bytes_per_step: int | None) -> None:
        self.optimizers, self.skips = optimizers, skips
        self.modelled_bytes_per_step = modelled_bytes_per_step

    @property
    def bytes_modelled(self) -> bool:
        """HSDP's all-reduce (mode off): FSDP does the comms, its bytes are modelled, not counted."""
        return self.modelled_bytes_per_step is not None

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def report(self, step: int) -> None:
        self.skips.after_step(step)

    def traffic(self) -> tuple[int, int]:
        """(sent, received) bytes of the step that just ran."""
        if self.bytes_modelled:
            return self.modelled_bytes_per_step, self.modelled_bytes_per_step
        return (sum(int(getattr(o, "last_step_bytes_sent", 0)) for o in self.optimizers),
                sum(int(getattr(o, "last_step_bytes_received", 0)) for o in self.optimizers))

    def exchange_seconds(self) -> float | None:
        if self.bytes_modelled:
            return None
        return sum(float(getattr(o, "last_step_exchange_seconds", 0.0)) for o in self.optimizers)

    @property
    def skipped_updates(self) -> int:
        return self.skips.count

    def resumed_at(self, step: int) -> None:
        self.skips.counted_through = step

    def shared_tensors(self, named_params: list) -> list:
        return list(named_params)

    def state_dict(self, *prefixes: str) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any], *prefixes: str) -> None:
        pass

    def keep_loads_for_again(self) -> None:
        pass

    def load_again(self) -> None:
        pass

    def heal_state(self) -> None:
        return None

    def load_heal_state(self, state) -> None:
        pass


class OuterCycle:
    """The DiLoCo modes: ``outer`` (flexdemo.optim.DiLoCo) around the inner optimizers."""

    checked = "global copy"
    bytes_modelled = False

    def __init__(self, outer: DiLoCo) -> None:
        self.outer = outer
        self._synced = False  # the last step ended with an outer step
        self._keep_loads = False  # keep a loaded state for load_again (0.3.0 only)
        self._loaded: tuple | None = None

    @property
    def compressor(self):
        return self.outer.compressor

    @property
    def settings(self) -> dict[str, str]:
        return self.outer.settings

    @property
    def last_sync_seconds(self) -> float | None:
        return self.outer.last_sync_seconds

    @property
    def at_cycle_start(self) -> bool:
        return self.outer.inner_steps == 0

    def before_step(self) -> None:
        self.outer.before_inner_step()

    def after_step(self) -> None:
        self._synced = self.outer.after_inner_step()

    def report(self, step: int) -> None:
        """The outer step that ended step ``step``, if one did: applied, not committed (elastic),
        or skipped on every replica (non-finite; DiLoCo counts those and stops the run itself)."""
        o = self.outer
        if not self._synced:
            return
        if o.last_sync_skipped:
            logger.warning(
                f"flexdemo: outer step after step {step} skipped on every replica ({o.skips.total} "
                f"skipped so far, {len(o.skips.in_a_row)} in a row): non-finite parameters on "
                f"{describe_nonfinite(o.last_skipped_by)}; every replica restarts from the global copy "
                "with a fresh inner optimizer state"
            )
        if not o.last_sync_committed:
            logger.warning(f"flexdemo: the outer step after step {step} was not committed (an elastic "
                           "replica failed during the exchange): nothing applied, the cycle goes on")
        else:
            sent, received = self.traffic()
            logger.info(
                f"flexdemo: outer step {o.outer_steps} after step {step} ({o.compression}, {sent} bytes sent, "
                f"{received} received over dp_replicate, {1e3 * o.last_sync_seconds:.1f} ms)"
            )

    def traffic(self) -> tuple[int, int]:
        return self.outer.last_traffic.sent, self.outer.last_traffic.received

    def exchange_seconds(self) -> float | None:
        return self.outer.last_exchange_seconds

    @property
    def skipped_updates(self) -> int:
        return self.outer.skips.total

    def resumed_at(self, step: int) -> None:
        pass  # the outer state (with its skip counts) comes back with the checkpoint

    def shared_tensors(self, named_params: list) -> list:
        return shared_tensors([], self.outer)

    def state_dict(self, *prefixes: str) -> dict[str, Any]:
        return self.outer.state_dict(*prefixes)

    def load_state_dict(self, state_dict: dict[str, Any], *prefixes: str) -> None:
        # Also restores each replica's own local parameters (the model's keys hold one
        # replica's shards only): runs after DCP has loaded the model's tensors.
        self.outer.load_state_dict(state_dict, *prefixes)
        if self._keep_loads:  # only where load_again will come (it holds the loaded outer state)
            self._loaded = (state_dict, prefixes)

    def keep_loads_for_again(self) -> None:
        """Keep each loaded state until :meth:`load_again` (the adapter that calls it says so)."""
        self._keep_loads = True

    def load_again(self) -> None:
        """The last load once more: torchtitan 0.3.0 copies the model's saved tensors (replica 0's)
        into the parameters after the optimizers' load (a fused parameter's are fresh tensors),
        overwriting this replica's own local parameters (flexdemo.titan.v0_3.trainer)."""
        # Once: a later load of the model (an elastic replica healing from a live peer) is the peer's.
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            self.outer.load_state_dict(loaded[0], *loaded[1])

    def heal_state(self):
        return self.outer.heal_state()

    def load_heal_state(self, state) -> None:
        self.outer.load_heal_state(state)
