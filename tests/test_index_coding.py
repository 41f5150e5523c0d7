"""index_coding = "elias_fano" changes the bytes, not the training: runs with Elias-Fano indices
equal runs with fixed-width ones bit for bit (per-step DeMo, the sharded exchange, demo_diloco's
outer step), with fewer bytes, counted from the collectives' own buffers."""

import sys

import pytest
import torch

from flexdemo import DeMo
from flexdemo.optim.diloco import DiLoCo
from multiproc import run_ranks
from titan_launch import REPO
from toy_problem import all_ranks_equal, backward_on, make_params, outer_sgd

sys.path.insert(0, str(REPO / "benchmarks"))
from exchange_bytes import count_collectives  # noqa: E402
from torchtitan_version import needs_torchtitan_0_2


def _demo_runs(rank, world, encoding, exchange, steps):
    counted = count_collectives()
    runs = {}
    for coding in ("fixed", "elias_fano"):
        params = make_params()
        # top-32 per 64 x 64 block: these small tensors' blocks keep 2-32 coefficients, where
        # Elias-Fano is shorter than fixed indices (at top-8 they keep 1-8: about even)
        opt = DeMo(params, lr=0.01, compression_decay=0.9, compression_topk=32, value_encoding=encoding,
                   weight_decay=0.1, exchange=exchange, index_coding=coding)
        trajectory, traffic = [], []
        for step in range(steps):
            backward_on(params, 1000 * rank + step)
            counted["sent"] = counted["received"] = 0
            opt.step()
            trajectory.append([p.detach().clone() for p in params])
            traffic.append((counted["sent"], counted["received"], opt.compressor.last_traffic.sent,
                            opt.compressor.last_traffic.received))
        runs[coding] = (trajectory, traffic, all_ranks_equal(params))
    (fixed, fixed_bytes, _), (ef, ef_bytes, identical) = runs["fixed"], runs["elias_fano"]
    same = [all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(fixed, ef)]
    return same, fixed_bytes, ef_bytes, identical


@pytest.mark.parametrize("encoding,exchange,world", [("sign", "allgather", 2), ("fp32", "allgather", 2),
                                                     ("scaled_sign", "sharded", 3)])
def test_elias_fano_trains_bit_identically_with_fewer_bytes(encoding, exchange, world):
    for same, fixed_bytes, ef_bytes, identical in run_ranks(_demo_runs, world, encoding, exchange, 5):
        assert all(same), f"parameters differ from the fixed-index run after steps {same}"
        assert identical, "replicas differ"
        for counted_sent, counted_received, sent, received in ef_bytes:
            assert (counted_sent, counted_received) == (sent, received) > (0, 0)  # the metrics are the bytes
        assert max(b[1] for b in ef_bytes) < min(b[1] for b in fixed_bytes)


def _outer_runs(rank, world, cycles, settings):
    ends = {}
    for coding in ("fixed", "elias_fano"):
        params = make_params()
        rest = {k: v for k, v in settings.items() if k not in ("outer_lr", "outer_momentum", "nesterov")}
        sgd = outer_sgd(params, lr=settings.get("outer_lr", 0.7), momentum=settings.get("outer_momentum", 0.9),
                        nesterov=settings.get("nesterov", True))
        outer = DiLoCo([(str(i), p) for i, p in enumerate(params)], outer_optimizer=sgd, sync_interval=2,
                       compression="topk", chunk=64, index_coding=coding, **rest)
        inner = torch.optim.AdamW(params, lr=1e-2)
        outer.set_inner_optimizers([inner])
        for step in range(2 * cycles):
            outer.before_inner_step()
            backward_on(params, 1000 * rank + step)
            inner.step()
            outer.after_inner_step()
        ends[coding] = ([p.detach().clone() for p in params], outer.last_traffic.received)
    return all(torch.equal(a, b) for a, b in zip(ends["fixed"][0], ends["elias_fano"][0])), \
        ends["elias_fano"][1] < ends["fixed"][1]


# DeMo-DiLoCo's DCT blocks, and SparseLoCo's raw blocks with 2-bit values (its preset at outer lr 3:
# results.md 10)
@pytest.mark.parametrize("settings", [
    dict(value_encoding="scaled_sign", topk=32),
    dict(value_encoding="two_bit", topk=64, transform="none", decay=0.95, outer_lr=3.0, outer_momentum=0.0,
         nesterov=False)], ids=["dct_scaled_sign", "sparseloco"])
def test_demo_diloco_outer_step_with_elias_fano_is_the_fixed_one(settings):
    assert run_ranks(_outer_runs, 2, 3, settings) == [(True, True), (True, True)]


@needs_torchtitan_0_2
def test_unknown_index_coding_is_refused():
    with pytest.raises(ValueError, match="unknown index_coding 'huffman'"):
        DeMo(make_params(), lr=0.01, index_coding="huffman")
    with pytest.raises(ValueError, match="unknown index_coding 'huffman'"):
        w = make_params()[0]
        DiLoCo([("0", w)], outer_optimizer=outer_sgd([w]), sync_interval=2, compression="dense",
               index_coding="huffman")
    from torchtitan.config import ConfigManager

    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    job = ConfigManager().parse_args(["--job.custom_config_module", "flexdemo.titan.config"])
    job.flexdemo.index_coding = "huffman"  # as a TOML file could say it (the CLI refuses it itself)
    with pytest.raises(FlexDemoConfigError, match="index_coding='huffman'"):
        validate_job_config(job, None)
