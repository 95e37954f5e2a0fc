import pytest
import torch

from flotilla.engine.model import AttentionMetadata, SeqChunk

CPU = torch.device("cpu")


def build_mixed() -> AttentionMetadata:
    # decode A at position 5, prefill B positions 2..6, then decode C at position 0 (decode rows 0 and 6)
    seqs = [SeqChunk(5, 1, [7, 3]), SeqChunk(2, 5, [9, 1, 8]), SeqChunk(0, 1, [4])]
    return AttentionMetadata.build(seqs, block_size=4, device=CPU)


def test_positions_and_slot_mapping():
    meta = build_mixed()
    assert meta.num_tokens == 7
    assert meta.positions.tolist() == [5, 2, 3, 4, 5, 6, 0]
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 1 * 4, 1 * 4 + 1, 1 * 4 + 2, 4 * 4]
    assert meta.context_lens.tolist() == [6, 7, 1]
    # B's third block is reserved ahead but not needed yet, so the table is cut to 2 blocks
    assert meta.block_tables.tolist() == [[7, 3], [9, 1], [4, 0]]


def test_decode_batch_with_decodes_out_of_order():
    (decode,) = build_mixed().decode_groups
    assert decode.token_indices.tolist() == [0, 6] and decode.token_slice is None
    # whole blocks, each table padded to the widest (2 blocks of 4) with block 0
    assert decode.block_ids.tolist() == [7, 3, 4, 0]
    assert decode.mask[:, 0, 0].tolist() == [[True] * 6 + [False] * 2, [True] + [False] * 7]


def test_decode_first_uses_a_slice():
    seqs = [SeqChunk(3, 1, [2]), SeqChunk(0, 1, [5]), SeqChunk(0, 3, [6])]
    (decode,) = AttentionMetadata.build(seqs, 4, CPU).decode_groups
    assert decode.token_slice == slice(0, 2)


def test_prefill_chunk_is_causal_with_offset():
    (chunk,) = build_mixed().prefills
    assert chunk.token_slice == slice(1, 6)
    assert chunk.block_ids.tolist() == [9, 1] and chunk.context_len == 7
    expected = torch.tensor([[k <= q for k in range(7)] for q in range(2, 7)])
    assert torch.equal(chunk.mask, expected)


def test_prefill_from_zero_uses_plain_causal():
    meta = AttentionMetadata.build([SeqChunk(0, 6, [3, 0])], 4, CPU)
    assert meta.decode_groups == () and meta.prefills[0].mask is None


@pytest.mark.parametrize(
    "seqs, message",
    [([], "at least one"), ([SeqChunk(0, 0, [1])], "bad chunk"), ([SeqChunk(3, 2, [1])], "cannot hold")],
)
def test_invalid_steps_raise(seqs, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(seqs, 4, CPU)


def test_decode_groups_cap_the_gathered_context():
    # contexts 4, 5, 8, 9 tokens; at most 12 padded tokens per group -> [4, 5] (2 x 5), [8] , [9]
    seqs = [SeqChunk(3, 1, [1]), SeqChunk(4, 1, [2, 3]), SeqChunk(7, 1, [4, 5]), SeqChunk(8, 1, [6, 7, 8])]
    groups = AttentionMetadata.build(seqs, 4, CPU, max_decode_group_tokens=12).decode_groups
    assert [g.token_slice for g in groups] == [slice(0, 2), slice(2, 3), slice(3, 4)]
    assert groups[0].block_ids.tolist() == [1, 0, 2, 3]


def test_window_masks_hide_keys_older_than_the_window():
    # decode at position 9 (context 10) and at position 2; prefill of positions 4..9 from an offset; window 4
    seqs = [SeqChunk(9, 1, [1, 2, 3]), SeqChunk(2, 1, [4]), SeqChunk(4, 6, [5, 6, 7])]
    meta = AttentionMetadata.build(seqs, 4, CPU, sliding_window=4)
    (decode,) = meta.decode_groups
    assert decode.window_mask[:, 0, 0].tolist() == [[False] * 6 + [True] * 4 + [False] * 2,
                                                    [True] * 3 + [False] * 9]
    (chunk,) = meta.prefills
    expected = torch.tensor([[q - 4 < k <= q for k in range(10)] for q in range(4, 10)])
    assert torch.equal(chunk.window_mask, expected)
    assert torch.equal(chunk.mask, torch.tensor([[k <= q for k in range(10)] for q in range(4, 10)]))  # full layers
    assert meta.sliding_window == 4


def test_window_masks_are_the_plain_ones_while_the_context_fits_the_window():
    meta = AttentionMetadata.build([SeqChunk(0, 6, [3, 0]), SeqChunk(3, 1, [1])], 4, CPU, sliding_window=6)
    assert meta.prefills[0].window_mask is None  # plain causal: SDPA's is_causal
    assert meta.decode_groups[0].window_mask is meta.decode_groups[0].mask
    longer = AttentionMetadata.build([SeqChunk(0, 7, [3, 0])], 4, CPU, sliding_window=6).prefills[0]
    assert longer.mask is None and not longer.window_mask[6, 0] and longer.window_mask[6, 1]


def test_window_prefill_reads_only_the_blocks_its_queries_can_see():
    # queries at 9..11 with a window of 4 see keys from 6 on: blocks from the second (keys 4..) are gathered
    (chunk,) = AttentionMetadata.build([SeqChunk(9, 3, [8, 5, 2])], 4, CPU, sliding_window=4).prefills
    assert chunk.block_ids.tolist() == [8, 5, 2] and chunk.window_block_ids.tolist() == [5, 2]
    assert chunk.window_key_start == 4
    expected = torch.tensor([[q - 4 < k <= q for k in range(4, 12)] for q in range(9, 12)])
    assert torch.equal(chunk.window_mask, expected)


def test_rope_lens_follow_the_prompt_length_when_given():
    # a prompt of 10 prefilled in chunks: every prompt token has rope length 10; a decode token its position + 1;
    # without a prompt length, the context length after the step
    seqs = [SeqChunk(4, 3, [1, 2], num_prompt_tokens=10), SeqChunk(12, 1, [3, 4, 5, 6], num_prompt_tokens=10),
            SeqChunk(0, 2, [7])]
    meta = AttentionMetadata.build(seqs, 4, CPU)
    assert meta.rope_lens.tolist() == [10, 10, 10, 13, 2, 2] and meta.max_rope_len == 13
