"""ParallelContext without process groups, and the Ulysses layout transforms checked against a simulated
all-to-all (every rank's blocks in one process): they shard heads exactly and invert each other, and kv
replication gives each rank the kv head its query heads use."""

from types import SimpleNamespace

import pytest
import torch

from actorcore.parallel import ParallelContext
from actorcore.parallel.ulysses import (
    check_heads,
    merge_head_blocks,
    merge_token_blocks,
    replicate_kv_heads,
    split_heads_into_blocks,
    split_tokens_into_blocks,
    valid_sp_sizes,
)


def test_context_without_groups_is_size_one():
    ctx = ParallelContext()
    assert (ctx.sp_size, ctx.sp_rank, ctx.dp_size, ctx.tp_size, ctx.pp_size, ctx.ep_size) == (1, 0, 1, 1, 1, 1)
    with pytest.raises(Exception):
        ctx.sp_group = object()  # frozen


def test_from_device_mesh_names_unknown_axes():
    mesh = SimpleNamespace(mesh_dim_names=("dp", "ulysses"), get_group=lambda name: None)
    with pytest.raises(ValueError, match=r"sp='sp' is not an axis of the device mesh; its axes are \('dp', 'ulysses'\)"):
        ParallelContext.from_device_mesh(mesh, sp="sp")
    with pytest.raises(ValueError, match="unknown parallel axes"):
        ParallelContext.from_device_mesh(mesh, seq="ulysses")


def _simulated_all_to_all(blocks_by_rank):
    """received[r][s] = sent[s][r]."""
    size = len(blocks_by_rank)
    return [torch.stack([blocks_by_rank[s][r] for s in range(size)]) for r in range(size)]


@pytest.mark.parametrize("sp,heads", [(2, 4), (4, 4), (2, 6), (3, 6)])
def test_sequence_head_exchange_is_exact_and_inverse(sp, heads):
    T, H = 12, 5
    x_TNH = torch.randn(T, heads, H)
    L, n = T // sp, heads // sp
    local = [x_TNH[r * L:(r + 1) * L] for r in range(sp)]
    received = _simulated_all_to_all([split_heads_into_blocks(x, sp) for x in local])
    head_sharded = [merge_token_blocks(b) for b in received]
    for r in range(sp):
        assert torch.equal(head_sharded[r], x_TNH[:, r * n:(r + 1) * n])
    back = _simulated_all_to_all([split_tokens_into_blocks(x, sp) for x in head_sharded])
    for r in range(sp):
        assert torch.equal(merge_head_blocks(back[r]), local[r])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (8, 2), (12, 4), (4, 4)])
def test_kv_replication_matches_query_groups(heads, kv_heads):
    for sp in valid_sp_sizes(heads, kv_heads):
        kv = torch.arange(kv_heads).float().reshape(1, kv_heads, 1)  # value = original kv head index
        rep = replicate_kv_heads(kv, sp)
        per_rank_kv = rep.shape[1] // sp
        for r in range(sp):
            rank_kv = rep[0, r * per_rank_kv:(r + 1) * per_rank_kv, 0].tolist()
            rank_q = range(r * heads // sp, (r + 1) * heads // sp)
            local_groups = len(rank_q) // per_rank_kv
            for i, q in enumerate(rank_q):
                assert rank_kv[i // local_groups] == q // (heads // kv_heads), (heads, kv_heads, sp, r, q)


def test_check_heads_names_valid_sizes():
    assert valid_sp_sizes(4, 2) == [1, 2, 4]
    check_heads(4, 2, 4)
    with pytest.raises(ValueError, match=r"sp_size=3.*Valid sp sizes for this model: \[1, 2, 4\]"):
        check_heads(4, 2, 3)
    with pytest.raises(ValueError, match=r"Valid sp sizes for this model: \[1, 2, 3, 6\]"):
        check_heads(6, 6, 4)
