"""Each block keeps top-k scaled to its share of a full block (chunk x chunk; a 1-D tensor's
chunk elements, as the DeMo reference keeps top-k per 1-D chunk: format 6), so the bytes per
parameter do not depend on how FSDP splits a tensor, small tensors included; blocks of
different k travel as sub-streams that unpack to what was selected.

The reference (reference_demo.reference_block_topks) counts each block's elements from a
zero-padded mask (not from the layout's edges) and rounds in floating point."""

import pytest
import torch

from flexdemo.compression.codec import compress, pack_blocks, unpack_blocks
from flexdemo.compression.buckets import build_plan
from flexdemo.wire.dct import block_layout
from flexdemo.wire.format import BlockTopks, block_topks, payload_nbytes
from reference_demo import reference_block_topks
from torchtitan_version import needs_torchtitan_0_2


@pytest.mark.parametrize("shape", [(4096, 4096), (1366, 4096), (100, 130), (16, 2048), (2048,), (300,), (7,), (),
                                   (3, 70, 40), (128, 2)])
@pytest.mark.parametrize("topk,chunk", [(32, 64), (8, 64), (256, 64), (5, 16)])
def test_each_block_keeps_its_share_of_the_top_k(shape, topk, chunk):
    layout = block_layout(shape, chunk)
    k, per_block = block_topks(layout, topk)
    want = reference_block_topks(shape, topk, chunk)
    assert list(per_block or [k] * layout.num_blocks) == want
    assert k == max(want) and (per_block is None) == (len(set(want)) == 1)


# By hand, chunk 64 (half up: 2 x topk x valid + full, floor-divided by 2 x full). 1-D, full area
# 64: a whole chunk keeps top-k (at most its 64 coefficients); 300 = 4 x 64 + 44, 44/64 of 32 =
# 22; 7 elements (one 7-element block): 7/64 of 32 = 3.5 -> 4; 0-D: 1.
# 2-D (and more), full area 4096: a 1 x 64 row keeps 64/4096 of 32 = 0.5 -> 1 (not the 1-D rule),
# 100 x 130's bottom-right corner (36 x 2 of its 64 x 64) 72/4096 of 32 = 0.56 -> 1.
HAND = [
    ((2048,), 32, [32] * 32),
    ((300,), 32, [32, 32, 32, 32, 22]),
    ((300,), 96, [64, 64, 64, 64, 64]),  # 44/64 of 96 = 66 -> the block's 64 coefficients (zero-padded)
    ((300,), 8, [8, 8, 8, 8, 6]),  # 44/64 of 8 = 5.5 -> 6
    ((7,), 32, [4]),
    ((), 32, [1]),
    ((1, 64), 32, [1]),
    ((64, 64), 32, [32]),
    ((100, 130), 32, [32, 32, 1, 18, 18, 1]),  # 36 x 64 = 2304/4096 of 32 = 18
]


@pytest.mark.parametrize("shape,topk,want", HAND)
def test_block_topks_by_hand(shape, topk, want):
    k, per_block = block_topks(block_layout(shape, 64), topk)
    assert list(per_block or [k] * block_layout(shape, 64).num_blocks) == want


def _kept(shape, topk, chunk):
    layout = block_layout(shape, chunk)
    k, per_block = block_topks(layout, topk)
    return sum(per_block) if per_block else k * layout.num_blocks


@pytest.mark.parametrize("numel", [2048, 8192, 768, 4097, 1000, 300])
@pytest.mark.parametrize("encoding", ["sign", "fp32"])
def test_a_1d_tensor_keeps_as_many_coefficients_over_1_2_or_3_shards(numel, encoding):
    # A norm weight or bias under FSDP (dim 0 cut like torch.chunk): the whole tensor keeps
    # top-k x numel / chunk (rounded once per partial chunk); each shard's partial last chunk
    # rounds its share once, so a split keeps within half a coefficient per shard of that. Its
    # bytes differ by those coefficients and by each rank's own byte alignment of its streams.
    topk, chunk = 32, 64
    kept, nbytes = {}, {}
    for shards in (1, 2, 3):
        parts = [tuple(p.shape) for p in torch.empty(numel, device="meta").chunk(shards, 0)]
        kept[shards] = sum(sum(reference_block_topks(p, topk, chunk)) for p in parts)
        assert kept[shards] == sum(_kept(p, topk, chunk) for p in parts)
        assert abs(kept[shards] - topk * numel / chunk) <= shards / 2, (shards, kept)
        if all(p[0] % chunk == 0 for p in parts):  # whole chunks only: exactly top-k each
            assert kept[shards] == topk * numel // chunk
        nbytes[shards] = sum(payload_nbytes(block_layout(p, chunk), topk, encoding) for p in parts)
    value_bits = 32 if encoding == "fp32" else 1
    for shards in (2, 3):
        # per rank at most two sub-streams (whole and partial chunks) of up to 3 byte-aligned
        # parts (indices, values, voter counts): a byte each, and a voter count per block
        slack = shards * 2 * 3 + shards
        assert abs(nbytes[shards] - nbytes[1]) <= abs(kept[shards] - kept[1]) * (6 + value_bits) / 8 + slack, nbytes


def _llama_debug_shapes():
    from torchtitan.models.llama3 import Transformer, llama3_args

    with torch.device("meta"):
        return [tuple(p.shape) for p in Transformer(llama3_args["debugmodel"]).parameters()]


@needs_torchtitan_0_2
@pytest.mark.parametrize("encoding", ["sign", "fp32"])
def test_bytes_per_parameter_do_not_depend_on_the_shard_count(encoding):
    # FSDP2 cuts dim 0 like torch.chunk. The CPU debug model (small matrices, norms) sent 1.23x
    # the bytes at 3 shards as at 2 when every partial block carried a full top-k.
    shapes = _llama_debug_shapes() + [(4096, 4096), (128256, 2048), (2048,), (256, 64)]
    per_degree = {}
    for degree in (1, 2, 3, 4, 6, 8):
        per_degree[degree] = sum(payload_nbytes(block_layout(s.shape, 64), 32, encoding)
                                 for shape in shapes for s in torch.empty(shape, device="meta").chunk(degree, 0))
    assert max(per_degree.values()) <= 1.05 * min(per_degree.values()), per_degree


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "sign", "scaled_sign", "two_bit"])
@pytest.mark.parametrize("index_coding", ["fixed", "elias_fano"])
def test_blocks_of_different_k_round_trip_through_their_sub_streams(encoding, index_coding):
    torch.manual_seed(0)
    shape, chunk, topk = (150, 100), 64, 40  # edge blocks of 22 rows, 36 columns, and the corner
    layout = block_layout(shape, chunk)
    k, per_block = block_topks(layout, topk)
    assert per_block is not None and len(set(per_block)) == 4
    acc = torch.randn(shape)
    row_k = torch.tensor(per_block)
    idx, vals = compress(acc.clone(), layout, k, encoding, row_k)
    # each block holds its own k voters (continuous data: no zero among them), the rest no vote
    assert torch.equal((vals != 0).sum(-1), row_k)
    stream = BlockTopks(per_block)
    payload = pack_blocks(idx, vals, stream, layout.block_numel, encoding, index_coding)
    assert payload.numel() == stream.nbytes(layout.block_numel, encoding, index_coding)
    assert payload.numel() == payload_nbytes(layout, topk, encoding, index_coding)
    got_idx, got_vals = unpack_blocks(payload.unsqueeze(0), layout.num_blocks, k, stream, layout.block_numel,
                                      encoding, torch.float32, index_coding)
    for b in range(layout.num_blocks):
        sent = {(int(i), float(v)) for i, v in zip(idx[b], vals[b]) if v != 0}
        got = {(int(i), float(v)) for i, v in zip(got_idx[0, b], got_vals[0, b]) if i >= 0}
        if encoding in ("fp32",):
            assert got == sent, b
        else:  # rounded or 1-bit values: the same coefficients, with the sent signs
            assert {i for i, _ in got} == {i for i, _ in sent}, b
            assert {(i, v > 0) for i, v in got} == {(i, v > 0) for i, v in sent}, b


def test_a_sharded_tensor_lands_in_ragged_buckets_on_the_torch_path():
    shard = torch.empty(1366, 256)  # 4096 rows over 3 shards: the last row of blocks has 22 rows
    whole = torch.empty(1024, 256)
    buckets, nbytes = build_plan([[(shard, shard.shape, shard.dtype), (whole, whole.shape, whole.dtype)]],
                                 [64], [32], "sign")
    assert sorted(b.ragged for b in buckets) == [False, True]
    ragged = next(b for b in buckets if b.ragged)
    assert ragged.k == 32 and sorted(set(ragged.per_block.per_block)) == [11, 32]
    assert nbytes == sum(payload_nbytes(block_layout(t.shape, 64), 32, "sign") for t in (shard, whole))


# torchtitan's llama3 TP plan: column-wise (dim 0) and row-wise (dim 1) linears, the embedding's
# rows; the norms are replicated, and one TP rank of a replica sends their blocks
# (flexdemo.compression.mesh_layout; tests/test_tp_replicated.py measures it).
_TP_DIM = {"tok_embeddings": 0, "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}


def _replica_bytes(flavor: str, tp: int, fsdp: int) -> int:
    """Payload bytes of one replica's ranks together: TP cuts each matrix as the plan says,
    then FSDP2 cuts dim 0 of the local part like torch.chunk."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    with torch.device("meta"):
        named = [(n, p) for n, p in Transformer(llama3_args[flavor]).named_parameters()]
    total = 0
    for name, p in named:
        dim = _TP_DIM.get(name.split(".")[-2])
        tp_parts = p.chunk(tp, dim) if dim is not None else [p]
        total += sum(payload_nbytes(block_layout(s.shape, 64), 32, "sign")
                     for part in tp_parts for s in part.chunk(fsdp, 0))
    return total


@needs_torchtitan_0_2
@pytest.mark.parametrize("flavor", ["debugmodel", "8B"])
def test_bytes_per_replica_do_not_depend_on_tensor_and_fsdp_degrees(flavor):
    per_layout = {(tp, fsdp): _replica_bytes(flavor, tp, fsdp) for tp in (1, 2, 4, 8) for fsdp in (1, 2, 3)}
    assert max(per_layout.values()) <= 1.05 * min(per_layout.values()), per_layout
