"""The context-parallel split of packed batches (``actorcore.context_split``) against plain-Python statements of
Megatron's load-balanced layout, and the attention of a rank's query chunks against a plain softmax."""

from __future__ import annotations

import collections
import itertools
import math
import random

import pytest
import torch

import actorcore as ac
from actorcore.batch import IGNORE_INDEX, pad_to_multiple
from actorcore.context_split import (
    cp_chunk_index,
    cp_gather_order,
    cp_local_positions,
    cp_padded_bounds,
    split_for_cp,
)
from actorcore.testing.tolerances import TOL


def _held_by(cp: int, rank: int, padded_length: int) -> list[int]:
    """Offsets rank ``rank`` holds of one padded segment: chunks ``rank`` and ``2cp-1-rank`` (plain Python)."""
    chunk = padded_length // (2 * cp)
    return [o for j in (rank, 2 * cp - 1 - rank) for o in range(j * chunk, (j + 1) * chunk)]


def test_chunk_index_is_megatrons_load_balanced_layout():
    # One segment of 8 tokens over cp=2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_chunk_index([0, 8], 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_index([0, 8], 2, 1).tolist() == [2, 3, 4, 5]
    rng = random.Random(0)
    for cp in (1, 2, 3, 4):
        lengths = [rng.randint(1, 30) for _ in range(5)]
        padded = cp_padded_bounds([0, *itertools.accumulate(lengths)], cp)
        assert [b - a for a, b in zip(padded[:-1], padded[1:])] == [math.ceil(n / (2 * cp)) * 2 * cp for n in lengths]
        for rank in range(cp):
            expected = [start + o for start, end in zip(padded[:-1], padded[1:])
                        for o in _held_by(cp, rank, end - start)]
            assert cp_chunk_index(padded, cp, rank).tolist() == expected
            assert cp_local_positions(padded, cp, rank).tolist() == [
                o for start, end in zip(padded[:-1], padded[1:]) for o in _held_by(cp, rank, end - start)]
        gathered = torch.cat([cp_chunk_index(padded, cp, r) for r in range(cp)])
        assert gathered[cp_gather_order(padded, cp)].tolist() == list(range(padded[-1]))


@pytest.mark.parametrize("cp", [2, 4])
def test_split_takes_labels_before_the_split_and_merges_back(cp):
    sequences = [torch.arange(10, 15), torch.tensor([40]), torch.arange(60, 73), torch.tensor([90, 91])]
    batch = pad_to_multiple(ac.pack(sequences), 8)  # a trailing padding segment, as for pipeline stages
    shards = [split_for_cp(batch, cp, r) for r in range(cp)]
    assert len({s.num_tokens for s in shards}) == 1 and shards[0].num_tokens % (2 * cp) == 0
    ids = batch.input_ids.tolist()
    ends = set(batch.cu_seqlens[1:].tolist())
    for shard in shards:
        assert shard.input_ids.numel() == shard.num_tokens // cp
        for local, source in enumerate(shard.source.tolist()):
            label = int(shard.labels[local])
            if source < 0:  # padding added to a segment: id 0, never scored
                assert int(shard.input_ids[local]) == 0 and label == IGNORE_INDEX
                continue
            assert int(shard.input_ids[local]) == ids[source]
            real_next = source + 1 not in ends and source < batch.num_real_tokens - 1
            assert label == (ids[source + 1] if real_next else IGNORE_INDEX)
            assert int(shard.position_ids[local]) == int(batch.position_ids[source])
    # Each rank's results, gathered in rank order, merge back to the batch's token order.
    values = torch.randn(batch.num_tokens, 3)
    gathered = torch.cat([s.take(values, float("nan")) for s in shards])
    assert torch.equal(shards[0].merge(gathered), values)
    # A chunk edge: rank 0's first chunk of sequence 0 (5 tokens padded to 8) ends at token 8/(2cp) - 1, whose
    # label is the next token, held by rank 1.
    edge = 8 // (2 * cp)
    assert int(shards[0].labels[edge - 1]) == ids[edge] and edge in shards[1].source.tolist()


def test_split_pads_to_a_common_total_and_refuses_what_it_cannot_do():
    batch = ac.pack([torch.arange(3, 8)])
    shard = split_for_cp(batch, 2, 1, total=24)
    assert shard.padded_bounds == (0, 8, 24) and shard.input_ids.numel() == 12
    with pytest.raises(ValueError, match="multiple of 2\\*cp=4"):
        split_for_cp(batch, 2, 0, total=10)
    with pytest.raises(ValueError, match="at least 8"):
        split_for_cp(batch, 2, 0, total=4)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        split_for_cp(batch, 2, 2)
    mrope = ac.batch.PackedBatch(input_ids=batch.input_ids, position_ids=batch.position_ids.expand(3, -1),
                                 cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    with pytest.raises(ValueError, match="M-RoPE / VLM batches are not supported"):
        split_for_cp(mrope, 2, 0)


def _plain_attention(q, k, v, positions, window, scale):
    """Softmax over keys ``j <= p`` (and ``p - j < window``) for queries at positions ``p``, GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qnh,knh->nqk", q.double(), k.double()) * scale
    j = torch.arange(k.shape[0])
    allowed = (j[None, :] <= positions[:, None]) & ((positions[:, None] - j[None, :]) < (window or 10**9))
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
    return torch.einsum("nqk,knh->qnh", probs, v.double())


@pytest.mark.parametrize("window", [None, 5])
def test_attention_at_positions_equals_plain_softmax(window):
    from actorcore.kernels.attention.varlen import causal_attention_at_positions

    gen = torch.Generator().manual_seed(3)
    padded = [0, 8, 24]  # two segments of a cp=2 layout
    keys = torch.randn(24, 2, 16, generator=gen)
    values = torch.randn(24, 2, 16, generator=gen)
    trace: collections.Counter = collections.Counter()
    for rank in range(2):
        index = cp_chunk_index(padded, 2, rank)
        positions = cp_local_positions(padded, 2, rank)
        q = torch.randn(index.numel(), 4, 16, generator=gen)
        cu_q = torch.tensor(padded) // 2
        got = causal_attention_at_positions(q, keys, values, cu_q, torch.tensor(padded), positions, scale=0.3,
                                            sliding_window=window, trace=trace)
        for (qs, qe), (ks, ke) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(padded[:-1], padded[1:])):
            ref = _plain_attention(q[qs:qe], keys[ks:ke], values[ks:ke], positions[qs:qe], window, 0.3)
            torch.testing.assert_close(got[qs:qe].double(), ref, atol=TOL["cp_attention_vs_reference_fp32"], rtol=0)
    assert trace == {"varlen_attention:at_positions": 2}


def test_parallel_context_has_a_cp_axis_and_mcore_layouts_take_cp():
    from actorcore.mcore.parallel import McoreParallel

    context = ac.ParallelContext()
    assert (context.cp_size, context.cp_rank) == (1, 0)
    assert McoreParallel(tp=2, cp=2, pp=2).world_size == 8
    assert McoreParallel(cp=2, ep=4).world_size == 4
    with pytest.raises(ValueError, match="cp must be >= 1"):
        McoreParallel(cp=0)


def test_hf_route_refuses_a_context_parallel_group():
    from types import SimpleNamespace

    from actorcore.parallel.context import sp_size

    with pytest.raises(ValueError, match="only the Megatron route reads"):
        sp_size(SimpleNamespace(sp_size=1, cp_size=2))


def test_packed_core_attention_refuses_cp_without_packed_batches():
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from actorcore.mcore.build.attention import PackedCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, context_parallel_size=2)
    attention = PackedCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp="group"))
    q = torch.randn(4, 1, 2, 16)
    with pytest.raises(ValueError, match="context parallelism in PackedCoreAttention needs packed \\(THD\\)"):
        attention(q, q, q, None)
