"""flexdemo: DCT/top-k compressed replica exchange (DeMo / FlexDeMo) for torchtitan."""

from flexdemo.optim import DeMo
from flexdemo.replica_check import ReplicaMismatchError, check_replicas_identical

__all__ = ["DeMo", "ReplicaMismatchError", "check_replicas_identical"]
