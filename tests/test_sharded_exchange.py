"""The sharded exchange (owners aggregate and re-compress): equal to the all_gather exchange bit
for bit at a full budget, equal to an independent reference when it re-compresses, replicas
bit-identical, and per-rank bytes flat in the number of replicas (gloo, 2 to 16 ranks)."""

import sys

import pytest
import torch

from flexdemo import DeMo
from flexdemo.compression import TopkCompressor
from flexdemo.optim.diloco import DiLoCo
from multiproc import run_ranks
from reference_demo import ReferenceDeMo, agrees_then_realign
from titan_launch import REPO
from toy_problem import INPUT_NUMEL, all_ranks_equal, backward_on, make_params, outer_sgd, step_both
from torchtitan_version import needs_torchtitan_0_2

TOPK = 8


def _full_budget_equals_allgather(rank, world, steps):
    sharded, gathered = make_params(0), make_params(0)
    kw = dict(lr=0.01, compression_decay=0.9, compression_topk=TOPK, compression_chunk=64, value_encoding="fp32")
    opt_s = DeMo(sharded, exchange="sharded", sharded_topk=world * TOPK, **kw)
    opt_g = DeMo(gathered, **kw)
    differing = []
    for step in range(steps):
        for params in (sharded, gathered):
            backward_on(params, seed=1000 * rank + step)  # every replica sees different data
        opt_s.step()
        opt_g.step()
        if not all(torch.equal(a, b) for a, b in zip(sharded, gathered)):
            differing.append(step)
    moved = sum(float((a.detach() - b.detach()).abs().sum()) for a, b in zip(sharded, make_params(0)))
    return differing, all_ranks_equal(sharded), moved


def test_full_budget_fp32_is_the_allgather_update_bit_for_bit_at_8_replicas():
    # sharded_topk >= W x topk keeps every coefficient any replica sent; fp32 carries the mean exactly.
    for differing, identical, moved in run_ranks(_full_budget_equals_allgather, 8, 6):
        assert differing == [], f"sharded and all_gather parameters differ after steps {differing}"
        assert identical, "replicas differ"
        assert moved > 0


def _outer_full_budget_equals_allgather(rank, world, cycles):
    sharded, gathered = make_params(0), make_params(0)
    kw = dict(sync_interval=2, compression="topk", value_encoding="fp32", topk=TOPK, chunk=64)
    outers = [DiLoCo([(str(i), p) for i, p in enumerate(sharded)], outer_optimizer=outer_sgd(sharded),
                     exchange="sharded", sharded_topk=world * TOPK, **kw),
              DiLoCo([(str(i), p) for i, p in enumerate(gathered)], outer_optimizer=outer_sgd(gathered), **kw)]
    inners = [torch.optim.AdamW(sharded, lr=1e-2), torch.optim.AdamW(gathered, lr=1e-2)]
    for outer, inner in zip(outers, inners):
        outer.set_inner_optimizers([inner])
    differing = []
    for step in range(2 * cycles):
        for params, inner, outer in zip((sharded, gathered), inners, outers):
            outer.before_inner_step()
            backward_on(params, seed=1000 * rank + step)
            inner.step()
            outer.after_inner_step()
        if not all(torch.equal(a, b) for a, b in zip(sharded, gathered)):
            differing.append(step)
    return differing, all_ranks_equal(sharded)


def test_demo_diloco_outer_step_full_budget_fp32_is_the_allgather_one_at_4_replicas():
    for differing, identical in run_ranks(_outer_full_budget_equals_allgather, 4, 3):
        assert differing == [], f"sharded and all_gather outer steps differ after inner steps {differing}"
        assert identical, "replicas differ"


def _against_reference(rank, world, encoding, k2, steps):
    ours, ref = make_params(0), make_params(0)
    kw = dict(lr=0.01, decay=0.9, topk=TOPK, chunk=64, weight_decay=0.0)
    opt = DeMo(ours, lr=kw["lr"], compression_decay=kw["decay"], compression_topk=TOPK, compression_chunk=64,
               value_encoding=encoding, exchange="sharded", sharded_topk=k2)
    reference = ReferenceDeMo(ref, encoding=encoding, sharded_topk=k2, **kw)
    gen = torch.Generator().manual_seed(1000 + rank)
    mismatched, diverged = [], []
    for step in range(steps):
        step_both(opt, reference, ours, ref, torch.randn(INPUT_NUMEL, generator=gen))
        if not agrees_then_realign(ours, ref, reference.last_decoded):  # see test_optim_plain
            mismatched.append(step)
        if not all_ranks_equal(ours):
            diverged.append(step)
    return mismatched, diverged


@pytest.mark.parametrize("encoding", ["sign", "scaled_sign", "bf16", "fp32"])
def test_recompressed_mean_matches_reference_at_3_replicas(encoding):
    # 3 owners: no block count of the toy shapes splits evenly; sharded_topk = topk truncates.
    for mismatched, diverged in run_ranks(_against_reference, 3, encoding, TOPK, 8):
        assert mismatched == [], f"differs from the reference at steps {mismatched}"
        assert diverged == [], f"replicas diverged at steps {diverged}"


# Enough blocks that each of 16 owners holds several of every bucket (with the toy shapes'
# few blocks, per-owner byte rounding would be most of the traffic); a partial edge block and a
# tensor smaller than a block included. Bytes are counted from the collectives' own buffers
# (benchmarks/exchange_bytes.py's counter), not from the library's accounting.
sys.path.insert(0, str(REPO / "benchmarks"))
from exchange_bytes import SMALL_SHAPES, count_collectives  # noqa: E402


def _traffic(rank, world):
    counted = count_collectives()
    params = [torch.zeros(s) for s in SMALL_SHAPES]
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for exchange in ("allgather", "sharded"):
        comp = TopkCompressor([params], [64], [32], "sign", None, exchange=exchange)
        payloads = [comp.encode(b, [torch.randn(m.param.shape, generator=gen) for m in b.members])
                    for b in comp.buckets]
        counted["sent"] = counted["received"] = 0
        gathered = comp.exchange(payloads)
        assert (comp.last_traffic.sent, comp.last_traffic.received) == (counted["sent"], counted["received"])
        rows = [comp.unpack(b, gathered) for b in comp.buckets]
        digest = torch.cat([torch.cat([i.reshape(-1).float(), v.reshape(-1)]) for i, v in rows])
        out[exchange] = (counted["sent"], counted["received"], comp.nbytes, all_ranks_equal([digest]))
    return out


@pytest.fixture(scope="module")
def at_two_replicas():
    return run_ranks(_traffic, 2)


def _check_ranks(results, world):
    for r in results:
        assert r["allgather"][3] and r["sharded"][3], "ranks decoded different bits"
        sent, received, payload, _ = r["allgather"]
        assert (sent, received) == (payload, (world - 1) * payload), "all_gather: (W - 1) payloads per rank"


def test_two_replicas_sharded_receives_half_a_payload_and_half_the_means(at_two_replicas):
    # Written from the wire format's sizes, not from the exchange's own accounting: per bucket the
    # other replica's coefficients of my blocks (1-bit values) and its means of its blocks (bf16,
    # the owners' encoding for 1-bit values), each about half of the whole; then its flag byte.
    _check_ranks(at_two_replicas, 2)
    from flexdemo.wire.dct import block_layout
    from flexdemo.wire.format import coefficients_nbytes
    from reference_demo import reference_block_topks, reference_payload_nbytes

    whole = reference_payload_nbytes(SMALL_SHAPES, 32, 64, "sign") + reference_payload_nbytes(SMALL_SHAPES, 32, 64,
                                                                                               "bf16") - 2
    half = whole / 2
    # an odd block count splits unevenly: a block's bytes (and a byte of alignment) per stream either way
    kinds = {(block_layout(s, 64).block_numel, k) for s in SMALL_SHAPES for k in reference_block_topks(s, 32, 64)}
    slack = sum(coefficients_nbytes(1, k, numel, "bf16") + 2 for numel, k in kinds)
    for r in at_two_replicas:
        assert abs(r["sharded"][1] - 1 - half) <= slack, (r["sharded"][1], half, slack)


@pytest.mark.parametrize("world", [3, 4, 5, 8, 16])
def test_bytes_per_rank_flat_in_replicas_for_sharded_and_linear_for_allgather(world, at_two_replicas):
    results = run_ranks(_traffic, world, timeout=600)
    _check_ranks(results, world)
    received, at_two = max(r["sharded"][1] for r in results), max(r["sharded"][1] for r in at_two_replicas)
    assert received <= 2 * at_two, f"W={world}: sharded {received} bytes received per rank vs {at_two} at W=2"


def test_bad_exchange_settings_fail_before_any_collective():
    params = make_params(0)
    with pytest.raises(ValueError, match="exchange must be one of"):
        DeMo(params, lr=0.01, exchange="ring")
    with pytest.raises(ValueError, match="overlap needs exchange"):
        DeMo(params, lr=0.01, overlap=True, exchange="sharded")
    with pytest.raises(ValueError, match="sharded_topk must be an int >= 0"):
        TopkCompressor([params], [64], [TOPK], "sign", None, exchange="sharded", sharded_topk=-1)


@needs_torchtitan_0_2
@pytest.mark.parametrize("flags, message", [
    (["--flexdemo.exchange", "sharded", "--flexdemo.overlap"], 'overlap = true needs exchange = "allgather"'),
    (["--flexdemo.sharded_topk", "-1"], "sharded_topk=-1; expected an integer >= 0"),
])
def test_bad_exchange_keys_are_one_config_error(flags, message):
    from torchtitan.config import ConfigManager

    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    job = ConfigManager().parse_args(["--job.custom_config_module", "flexdemo.titan.config", *flags])
    with pytest.raises(FlexDemoConfigError, match=message):
        validate_job_config(job, None)


def test_modelled_1b_table_stays_flat_to_1024_replicas():
    from exchange_bytes import model

    rows = model([2, 16, 1024], 32, "sign", 0)
    assert all(r["sharded"] <= 2 * rows[0]["sharded"] for r in rows)
    assert [r["allgather"] for r in rows] == [(r["W"] - 1) * rows[0]["allgather"] for r in rows]
