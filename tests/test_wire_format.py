"""The wire format pinned by golden bytes, each derived by hand below (not by running the codec).

Blocks of 4 x 4 = 16 coefficients (4-bit indices), k = 2 kept per block, two blocks:
block 0 keeps index 3 (value -1.5) and index 10 (value 2.0); block 1 keeps index 5 (0.75) and
index 0 with value 0.0, a kept zero that casts no vote.

- indices, 4 bits each, LSB first: 3 | 10 << 4 = 0xA3, then 5 | 0 << 4 = 0x05.
- sign bits (1 = negative), one per slot in order: 1, 0, 0, 0 -> 0x01.
- voter counts, bits_for(k + 1) = 2 bits per block: 2 | 1 << 2 = 0x06.
- scaled_sign: then one fp32 scale per block, the mean |value| of its voters:
  (1.5 + 2.0) / 2 = 1.75 = 0x3FE00000 -> 00 00 E0 3F; 0.75 = 0x3F400000 -> 00 00 40 3F.
- fp32 values, little endian: -1.5 = 0xBFC00000, 2.0 = 0x40000000, 0.75 = 0x3F400000, 0.0.
- bf16 values: the top halves: C0 BF, 00 40, 40 3F, 00 00.
- two_bit: the sign bits, then size bits (1 = the block's high level): block 0 splits at its
  mean magnitude 1.75 into low 1.5 and high 2.0, block 1's one voter is high: 0, 1, 1, 0 ->
  0x06; the voter counts 0x06; then (low, high) per block in fp32: 1.5 = 0x3FC00000, 2.0,
  and 0.75, 0.75 (one level: both the same).
Elias-Fano indices (index_coding = "elias_fano"), the same two blocks given in another slot
order, [10, 3] and [0 (the kept zero), 5]: each block's voters sorted by position, then its
non-voters at position 15: [3, 10] and [5, 15], values in that order (as above).
- low bits: l = floor(log2(16 / 2)) = 3 bits each, LSB first: 3, 10 & 7 = 2, 5, 15 & 7 = 7 ->
  bits 110 010 101 111 -> 0x53, 0x0F.
- high parts in unary: bit (p >> 3) + i of a k + (15 >> 3) + 1 = 4-bit vector per block:
  block 0: 0 + 0, 1 + 1 -> 1010; block 1: 0 + 0, 1 + 1 -> 1010; -> 0x55.
- then the values exactly as in the fixed layout.
Blocks of different k (format 5: top-k scaled to each block's share of chunk x chunk), the two
blocks above keeping k = 2 and k = 1 (block 1's second slot is then no vote), sign values: one
sub-stream per k, the larger k first, each byte-aligned as above:
- k = 2, block 0: indices 0xA3; signs 1, 0 -> 0x01; voter count 2 in bits_for(3) = 2 bits -> 0x02;
- k = 1, block 1: index 5 -> 0x05; sign 0 -> 0x00; voter count 1 in bits_for(2) = 1 bit -> 0x01.
These are format version 6 (3: the sharded exchange's owners send the means of 1-bit values as
bf16; 4: Elias-Fano indices and two_bit values; 5: per-block top-k; 6: a 1-D tensor's chunks keep
top-k x valid / chunk, which changes how many coefficients a 1-D block keeps, not how blocks of a
given k are written: these vectors are 5's); a change to any of these bytes, or to how many
coefficients a block keeps (tests/test_block_topk.py), must bump WIRE_FORMAT_VERSION.
"""

import pytest
import torch

from flexdemo.compression.codec import pack_blocks, pack_payload, scaled_signs, unpack_blocks, unpack_payload
from flexdemo.wire.format import WIRE_FORMAT_VERSION, BlockTopks, means_encoding

IDX = torch.tensor([[3, 10], [5, 0]])
VALS = torch.tensor([[-1.5, 2.0], [0.75, 0.0]])
HEAD = [0xA3, 0x05]
GOLDEN = {
    "sign": HEAD + [0x01, 0x06],
    "scaled_sign": HEAD + [0x01, 0x06, 0x00, 0x00, 0xE0, 0x3F, 0x00, 0x00, 0x40, 0x3F],
    "fp32": HEAD + [0x00, 0x00, 0xC0, 0xBF, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x40, 0x3F, 0x00, 0x00, 0x00, 0x00],
    "bf16": HEAD + [0xC0, 0xBF, 0x00, 0x40, 0x40, 0x3F, 0x00, 0x00],
    "two_bit": HEAD + [0x01, 0x06, 0x06, 0x00, 0x00, 0xC0, 0x3F, 0x00, 0x00, 0x00, 0x40,
                       0x00, 0x00, 0x40, 0x3F, 0x00, 0x00, 0x40, 0x3F],
}
# What a receiver reads back: the kept zero as index -1, value 0 (no vote).
DECODED_IDX = [[3, 10], [5, -1]]
DECODED_VALS = {
    "sign": [[-1.0, 1.0], [1.0, 0.0]],
    "scaled_sign": [[-1.75, 1.75], [0.75, 0.0]],
    "fp32": [[-1.5, 2.0], [0.75, 0.0]],
    "bf16": [[-1.5, 2.0], [0.75, 0.0]],
    "two_bit": [[-1.5, 2.0], [0.75, 0.0]],
}


def sent(encoding):
    return scaled_signs(VALS) if encoding == "scaled_sign" else VALS


def test_these_vectors_are_format_version_6():
    assert WIRE_FORMAT_VERSION == 6
    # the owners' means (sharded exchange) are the bf16 vectors below for 1-bit values
    assert [means_encoding(e) for e in GOLDEN] == ["bf16", "bf16", "fp32", "bf16", "bf16"]


@pytest.mark.parametrize("encoding", list(GOLDEN))
def test_pack_gives_the_golden_bytes(encoding):
    assert pack_payload(IDX, sent(encoding), 16, encoding).tolist() == GOLDEN[encoding]


@pytest.mark.parametrize("encoding", list(GOLDEN))
def test_the_golden_bytes_decode_to_the_votes(encoding):
    payload = torch.tensor(GOLDEN[encoding], dtype=torch.uint8).unsqueeze(0)
    idx, vals = unpack_payload(payload, 2, 2, 16, encoding, torch.float32)
    assert idx[0].tolist() == DECODED_IDX and vals[0].tolist() == DECODED_VALS[encoding]


def test_a_kept_zero_before_a_voter_is_sent_after_it():
    # One block, index 7 holding 0.0 and index 9 holding -3.0: sent voters first, so the
    # indices are 9 | 7 << 4 = 0x79, the signs 1, 0 -> 0x01 and the voter count 1 -> 0x01.
    payload = pack_payload(torch.tensor([[7, 9]]), torch.tensor([[0.0, -3.0]]), 16, "sign")
    assert payload.tolist() == [0x79, 0x01, 0x01]


IDX_EF = torch.tensor([[10, 3], [0, 5]])  # the blocks above, in another slot order
VALS_EF = torch.tensor([[2.0, -1.5], [0.0, 0.75]])
HEAD_EF = [0x53, 0x0F, 0x55]


@pytest.mark.parametrize("encoding", list(GOLDEN))
def test_elias_fano_indices_give_the_golden_bytes_and_decode_to_the_votes(encoding):
    vals = scaled_signs(VALS_EF) if encoding == "scaled_sign" else VALS_EF
    golden = HEAD_EF + GOLDEN[encoding][len(HEAD):]
    assert pack_payload(IDX_EF, vals, 16, encoding, "elias_fano").tolist() == golden
    payload = torch.tensor(golden, dtype=torch.uint8).unsqueeze(0)
    idx, decoded = unpack_payload(payload, 2, 2, 16, encoding, torch.float32, "elias_fano")
    assert idx[0].tolist() == DECODED_IDX and decoded[0].tolist() == DECODED_VALS[encoding]


def test_blocks_of_different_k_give_the_golden_sub_streams():
    per_block = BlockTopks((2, 1))
    golden = [0xA3, 0x01, 0x02, 0x05, 0x00, 0x01]
    assert pack_blocks(IDX, VALS, per_block, 16, "sign").tolist() == golden
    idx, vals = unpack_blocks(torch.tensor(golden, dtype=torch.uint8).unsqueeze(0), 2, 2, per_block, 16, "sign",
                              torch.float32)
    assert idx[0].tolist() == [[3, 10], [5, -1]] and vals[0].tolist() == [[-1.0, 1.0], [1.0, 0.0]]
