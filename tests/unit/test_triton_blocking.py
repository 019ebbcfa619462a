"""CPU tests of the Triton engine's launch and blocking arithmetic (``triton_blocking``: no triton needed).

Shape suffixes: T tokens, D hidden, V vocab.
"""

from __future__ import annotations

import pytest
import torch

from actorcore.kernels.logprob import triton_blocking as tb

QWEN_V = 151936  # the benchmarks' vocabulary (docs/benchmarks.md)


@pytest.mark.parametrize("n_tok,dim,vocab", [(16384, 4096, QWEN_V), (32768, 4096, QWEN_V), (1000, 64, 4099),
                                             (7, 48, 131), (100000, 8192, 256000), (3, 5, 8193)])
@pytest.mark.parametrize("need_hidden", [True, False])
def test_backward_block_workspace_stays_within_budget(n_tok, dim, vocab, need_hidden):
    tokens, rows_v = tb.backward_blocks(n_tok, dim, vocab, need_hidden=need_hidden)
    assert 1 <= tokens <= n_tok and rows_v == min(vocab, tb.BACKWARD_VOCAB_BLOCK)
    used = tb.backward_workspace_bytes(tokens, dim, vocab, rows_v, need_hidden)
    assert used <= tb.BACKWARD_WORKSPACE_BYTES
    if tokens < n_tok:  # as many tokens as fit, rounded down to a multiple of 128 only from 256 up
        one_more = tokens + (128 if tokens >= 256 else 1)
        assert tb.backward_workspace_bytes(one_more, dim, vocab, rows_v, need_hidden) > tb.BACKWARD_WORKSPACE_BYTES
        assert tokens % 128 == 0 or tokens < 256


def test_backward_blocks_at_the_benchmark_shape():
    """H=4096, V=151936: 2048 tokens x 8192 vocabulary rows (the measured default), 64 MiB exactly."""
    assert tb.backward_blocks(16384, 4096, QWEN_V, need_hidden=True) == (2048, 8192)
    assert tb.backward_workspace_bytes(2048, 4096, QWEN_V, 8192, True) == 64 << 20
    # without grad_hidden there is no fp32 accumulator: 4096 tokens of 16-bit grad_logits
    assert tb.backward_blocks(16384, 4096, QWEN_V, need_hidden=False) == (4096, 8192)
    # one vocabulary block (V <= 8192): no accumulator either, the rows padded to 64 columns
    assert tb.backward_workspace_bytes(10, 64, 131, 131, True) == 10 * 2 * 192


def test_backward_blocks_chunk_size_and_small_budgets():
    assert tb.backward_blocks(5000, 4096, QWEN_V, need_hidden=True, chunk_size=97) == (97, 8192)
    assert tb.backward_blocks(50, 4096, QWEN_V, need_hidden=True, chunk_size=97) == (50, 8192)
    # the GPU test's "many small blocks" engine: 256 vocabulary rows in a 1 MiB workspace
    tokens, rows_v = tb.backward_blocks(1000, 64, 4099, need_hidden=True, vocab_block=256, budget=1 << 20)
    assert (tokens, rows_v) == (1000, 256)
    assert tb.backward_blocks(10**6, 10**6, QWEN_V, need_hidden=True, budget=1) == (1, 8192)  # never 0


@pytest.mark.parametrize("n_tok,vocab", [(1, 131), (1024, QWEN_V), (16384, QWEN_V), (768, QWEN_V), (301, 32003)])
@pytest.mark.parametrize("sms", [132, 78, 1])
def test_forward_splits_cover_the_vocabulary_exactly_once(n_tok, vocab, sms):
    cfg = tb.FWD_CONFIG
    t_tiles, per_split, splits = tb.forward_grid(n_tok, vocab, cfg, sms)
    v_tiles = tb.cdiv(vocab, cfg.block_v)
    assert t_tiles * cfg.block_t >= n_tok > (t_tiles - 1) * cfg.block_t
    assert 4 <= per_split <= 32
    assert splits * per_split >= v_tiles > (splits - 1) * per_split  # no split starts past the vocabulary
    assert splits * per_split * cfg.block_v >= vocab


def test_forward_tiles_per_split_against_wave_quantization():
    """Per split k, the launch costs ceil(t_tiles * ceil(v_tiles / k) / sms) * k tile-times; the least wins."""
    v_tiles = tb.cdiv(QWEN_V, 256)  # 594
    # the documented choices on the H200 (132 SMs): 18 at N=16384, 27 for a 768-token chunk
    assert tb.forward_tiles_per_split(16384 // 128, v_tiles, 132) == 18
    assert tb.forward_tiles_per_split(768 // 128, v_tiles, 132) == 27
    # 78 SMs: k=23 gives 6 x 26 = 156 programs, two full waves (46 tile-times); 27 would take 3 waves (81)
    assert tb.forward_tiles_per_split(768 // 128, v_tiles, 78) == 23
    # when every k fits in one wave, the cost is k itself (masked tiles count): the smallest k
    assert tb.forward_tiles_per_split(1, 64, 10**6) == 4
    assert tb.forward_tiles_per_split(1, 1, 132) == 4
    # equal costs go to the larger k: 2 token tiles x 64 vocabulary tiles on 4 SMs cost 32 at k = 4, 8, 16, 32
    assert tb.forward_tiles_per_split(2, 64, 4) == 32


def test_default_loss_rows_keep_the_chunk_buffer_within_budget():
    assert tb.default_loss_rows(QWEN_V) == 2176  # 16-bit [rows, V] buffer of at most 640 MiB
    for vocab in (131, 4099, QWEN_V, 256000, 10**8):
        rows = tb.default_loss_rows(vocab)
        assert rows >= 1
        assert rows * 2 * tb.padded_row(vocab) <= tb.FUSED_LOSS_WORKSPACE_BYTES or rows == 1


@pytest.mark.parametrize("n_tok", [1, 127, 2048, 2177, 8192, 32768, 65536, 100003])
@pytest.mark.parametrize("vocab", [4099, QWEN_V, 262144])
def test_loss_chunks_are_equal_tiles_within_the_budget(n_tok, vocab):
    rows = tb.loss_chunk_rows(n_tok, vocab)
    most = tb.default_loss_rows(vocab)
    chunks = -(-n_tok // rows)
    assert 1 <= rows <= min(most, n_tok)
    assert chunks == -(-n_tok // most)  # no more chunks than the budget forces
    assert rows == n_tok or rows % 128 == 0 or rows == most  # whole 128-token tiles
    assert chunks * rows - n_tok < rows  # the last chunk is not empty


def test_loss_chunks_at_the_benchmark_shapes_and_caller_chunk_size():
    assert tb.loss_chunk_rows(32768, QWEN_V) == 2048  # 16 chunks of 2048, not 15 of 2176 and a sliver
    assert tb.loss_chunk_rows(8192, QWEN_V) == 2048
    assert tb.loss_chunk_rows(16384, 262144) == 1280
    assert tb.loss_chunk_rows(300, QWEN_V) == 300
    assert tb.loss_chunk_rows(32768, QWEN_V, chunk_size=97) == 97
    assert tb.loss_chunk_rows(50, QWEN_V, chunk_size=97) == 50


def test_padded_row_and_tma_layout_check():
    assert [tb.padded_row(w) for w in (1, 64, 65, 8192)] == [64, 64, 128, 8192]
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert tb.tma_compatible(x, x[:, :32])  # unit last stride, 128-byte rows
    assert not tb.tma_compatible(x[:, ::2])  # strided columns
    assert not tb.tma_compatible(torch.zeros(16, 100, dtype=torch.bfloat16))  # 200-byte rows
    assert not tb.tma_compatible(x[:, 1:])  # base off the 16-byte alignment
