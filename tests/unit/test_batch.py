"""Data layer: exact, pure transforms and their errors."""

import pytest
import torch

import actorcore as ac
from actorcore.batch import (
    IGNORE_INDEX,
    next_token_labels,
    pad_to_multiple,
    sequence_start_mask,
    shard_for_sp,
    shift_to_predicting,
    shift_to_scored_token,
    to_scored_tokens,
    unpad,
)


def _seqs():
    return [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]


def test_pack_layout():
    b = ac.pack(_seqs())
    assert b.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert b.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert b.cu_seqlens.dtype == torch.int32
    assert b.max_seqlen == 3
    assert b.num_sequences == 3 and b.num_tokens == 6 and b.seq_lens == [3, 1, 2]


@pytest.mark.parametrize("left", [False, True])
def test_pack_padded_matches_pack(left):
    ids = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    if left:
        ids = torch.tensor([[5, 6, 7], [0, 0, 8], [0, 9, 10]])
        mask = mask.flip(-1)
    b = ac.pack_padded(ids, mask)
    ref = ac.pack(_seqs())
    assert torch.equal(b.input_ids, ref.input_ids)
    assert torch.equal(b.position_ids, ref.position_ids)
    assert torch.equal(b.cu_seqlens, ref.cu_seqlens)


def test_unpack_right_pads_with_zero():
    b = ac.pack(_seqs())
    values = torch.arange(1.0, 7.0)
    assert ac.unpack(values, b).tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]


def test_labels_never_cross_sequences():
    b = ac.pack(_seqs())
    labels, valid = next_token_labels(b)
    assert labels.tolist() == [6, 7, IGNORE_INDEX, IGNORE_INDEX, 10, IGNORE_INDEX]
    assert valid.tolist() == [True, True, False, False, True, False]
    scored = shift_to_scored_token(torch.where(valid, torch.arange(1.0, 7.0), 0.0))
    assert scored.tolist() == [0, 1, 2, 0, 0, 5]  # 0 at each sequence's first token
    assert sequence_start_mask(b).tolist() == [True, False, False, True, True, False]


def test_shift_to_predicting_undoes_shift_to_scored_token():
    """Rows of the scored tokens move to the positions predicting them and come back exactly; rows of sequence
    starts (nothing scores them) move to positions that predict nothing and are zeroed; padding positions get 0."""
    b = pad_to_multiple(ac.pack(_seqs()), 4)  # 6 real tokens, 2 padding
    _, valid = next_token_labels(b)
    scored = torch.tensor([[1.0, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]])
    moved = shift_to_predicting(scored, valid)
    assert moved.tolist() == [[3, 4], [5, 6], [0, 0], [0, 0], [11, 12], [0, 0], [0, 0], [0, 0]]
    back = to_scored_tokens(moved[:, 0], valid, b)
    starts = torch.tensor([True, False, False, True, True, False])
    assert back.tolist() == torch.where(starts, 0.0, scored[:, 0]).tolist()
    assert shift_to_predicting(torch.tensor([4.0]), torch.tensor([False])).tolist() == [0.0]
    with pytest.raises(ValueError, match="one row per real token"):
        shift_to_predicting(torch.zeros(9), valid)


def test_pad_to_multiple_adds_own_segment():
    b = ac.pack(_seqs())
    p = pad_to_multiple(b, 4)
    assert p.num_tokens == 8 and p.num_padding == 2 and p.num_sequences == 3
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6, 8]
    assert p.position_ids.tolist()[-2:] == [0, 1]
    labels, valid = next_token_labels(p)
    assert labels.tolist()[-3:] == [IGNORE_INDEX] * 3
    assert unpad(torch.arange(8), p).tolist() == list(range(6))
    assert pad_to_multiple(b, 3) is b  # already a multiple
    assert ac.unpack(torch.arange(8.0), p).shape == (3, 3)


def test_pad_to_multiple_mrope_positions():
    b = ac.pack(_seqs())
    b3 = type(b)(b.input_ids, b.position_ids.expand(3, -1).clone(), b.cu_seqlens, b.max_seqlen)
    p = pad_to_multiple(b3, 4)
    assert p.position_ids.shape == (3, 8)


def test_shard_for_sp_is_contiguous_and_complete():
    x = torch.arange(12)
    shards = [shard_for_sp(x, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(shards), x)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        shard_for_sp(torch.arange(7), 0, 2)


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "empty list"),
        ([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], "sequence 1 is empty"),
        ([torch.tensor([[1, 2]])], "1-D"),
        ([torch.tensor([1.0, 2.0])], "integer"),
        ([[1, 2]], "torch.Tensor"),
    ],
)
def test_pack_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        ac.pack(bad)


def test_pack_rejects_padded_tensor():
    with pytest.raises(ValueError, match="pack_padded"):
        ac.pack(torch.ones(2, 3, dtype=torch.long))


@pytest.mark.parametrize(
    "mask, match",
    [
        ([[1, 2, 1]], "only 0 and 1"),
        ([[1, 0, 1]], "holes"),
        ([[0, 0, 0]], "all zeros"),
        ([[1, 1]], "does not match"),
    ],
)
def test_pack_padded_mask_errors(mask, match):
    with pytest.raises(ValueError, match=match):
        ac.pack_padded(torch.tensor([[4, 5, 6]]), torch.tensor(mask))


def test_pack_padded_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        ac.pack_padded(torch.tensor([4, 5]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="integer"):
        ac.pack_padded(torch.tensor([[4.0]]), torch.tensor([[1]]))


def test_unpack_wrong_length():
    with pytest.raises(ValueError, match="tokens"):
        ac.unpack(torch.zeros(5), ac.pack(_seqs()))


def test_pack_takes_a_generator():
    seqs = [torch.tensor([3, 4, 5]), torch.tensor([6])]
    assert torch.equal(ac.pack(s for s in seqs).input_ids, ac.pack(seqs).input_ids)


def test_unpack_of_a_scalar_says_what_it_takes():
    with pytest.raises(ValueError, match=r"per-token values \[T, \.\.\.\].*0-d tensor"):
        ac.unpack(torch.tensor(1.0), ac.pack([torch.tensor([3, 4])]))


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([0, 3, 2, 5], dtype=torch.int32), "increase strictly"),
    (torch.tensor([0.0, 2.0, 5.0]), "int32/int64"),
    (torch.tensor([0, 2, 4], dtype=torch.int32), "end at the token count 5"),
    (torch.tensor([1, 2, 5], dtype=torch.int32), "start at 0"),
])
def test_hand_built_batch_is_validated_on_construction(cu, match):
    from actorcore.batch import PackedBatch

    ids = torch.arange(3, 8)
    with pytest.raises(ValueError, match=match):
        PackedBatch(input_ids=ids, position_ids=torch.zeros(5, dtype=torch.long), cu_seqlens=cu, max_seqlen=5)
