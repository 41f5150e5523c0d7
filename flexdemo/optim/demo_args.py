"""What a :class:`~flexdemo.optim.demo.DeMo` may be built with: the check of its arguments and of
each param group's hyperparameters (one ``DeMo: ...`` ValueError each)."""

from __future__ import annotations

from flexdemo.compression.compressor import EXCHANGES
from flexdemo.wire.format import check_encoding

NONFINITE_ACTIONS = ("skip", "stop")


def check_hparams(lr, decay, topk, chunk, weight_decay) -> None:
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"DeMo: lr must be a positive number, got {lr!r}")
    if not (isinstance(decay, (int, float)) and 0.0 <= decay < 1.0):
        raise ValueError(f"DeMo: compression_decay must be in [0, 1), got {decay!r}")
    if not (isinstance(topk, int) and not isinstance(topk, bool) and topk > 0):
        raise ValueError(f"DeMo: compression_topk must be a positive int, got {topk!r}")
    if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0):
        raise ValueError(f"DeMo: compression_chunk must be a positive int, got {chunk!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"DeMo: weight_decay must be >= 0, got {weight_decay!r}")


def check_args(lookahead, overlap, value_encoding, exchange, fused, nonfinite) -> None:
    if not isinstance(lookahead, bool):
        raise ValueError(f"DeMo: lookahead must be True or False, got {lookahead!r}")
    if lookahead and not overlap:
        raise ValueError("DeMo: lookahead needs overlap=True (it stands in for the update still in flight)")
    check_encoding(value_encoding)
    if exchange not in EXCHANGES:
        raise ValueError(f"DeMo: exchange must be one of {EXCHANGES}, got {exchange!r}")
    if overlap and exchange == "sharded":
        raise ValueError("DeMo: overlap needs exchange=\"allgather\" (the sharded exchange's two collectives, "
                         "with the owners' work between them, cannot be left in flight)")
    if not isinstance(fused, bool):
        raise ValueError(f"DeMo: fused must be True or False, got {fused!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"DeMo: overlap must be True or False, got {overlap!r}")
    if nonfinite not in NONFINITE_ACTIONS:
        raise ValueError(f"DeMo: nonfinite must be one of {NONFINITE_ACTIONS}, got {nonfinite!r}")
