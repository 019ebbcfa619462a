"""Launch and blocking arithmetic of the Triton engine: tiles, vocabulary splits, backward blocks, workspaces.

Pure integer arithmetic (and a layout check on tensors), importing torch only, so it is tested on the CPU;
``triton_engine`` launches what it decides. Shape suffixes: T tokens, D hidden, V vocab rows.

The numbers are the H200 choices of ``bench/logprob.py --sweep`` (N=16384, H=4096, V=151936, bf16) and
``bench/logprob_variants.py`` (N=32768); docs/benchmarks.md and docs/bench_head.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Backward workspace in bytes: the fp32 grad_hidden accumulator of one token block plus its 16-bit
# [tokens, vocabulary block] grad_logits tile (``backward_blocks``).
BACKWARD_WORKSPACE_BYTES = 64 << 20
# Vocabulary rows per backward block (a multiple of every BLOCK_V used here). With 64 MiB this gives
# 2048-token blocks at H=4096, measured fastest of the blockings tried.
BACKWARD_VOCAB_BLOCK = 8192
# Bytes of the loss-fused forward's chunk buffer: 16-bit [C, padded V] (fp16 shifted logits, then grad_logits
# in place), 2048 tokens at V=151936: the fp32 buffer of 1024 tokens that the cuBLAS-logits design needed.
FUSED_LOSS_WORKSPACE_BYTES = 640 << 20
# Rows of 16-bit grad_logits and fp16 logits buffers are padded to this many columns (16-byte rows).
ROW_ALIGN = 64


@dataclass(frozen=True)
class Config:
    """Tile shape and pipeline of one kernel; ``group`` token tiles are launched together for L2 reuse.

    ``persistent``: one program per SM looping over the tiles (the backward's recompute kernel);
    ``tma_store``: tiles written through the TMA engine (asynchronous, overlapping the next tile);
    ``flatten``: Triton flattens the tile and K loops into one pipelined loop (next tile's loads during
    this tile's epilogue). Two more options were measured slower on the H200 and removed: a subtiled epilogue
    and Triton's automatic warp specialisation (docs/bench_head.md).
    """

    block_t: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int
    group: int = 8
    persistent: bool = False
    tma_store: bool = False
    flatten: bool = False


# Forward 626 TFLOP/s with TMA loads (``flatten`` and warp specialisation measured within run-to-run noise of it).
FWD_CONFIG = Config(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=3, group=16)
# The per-token backward's recompute kernel: persistent, TMA loads and stores where the layout allows
# (otherwise the pointer-load kernel, one tile per program). Per-token forward+backward at N=32768,
# H=4096, V=151936 on the H200: 270.5 ms one tile per program, 261.7 persistent, 265.3 persistent + flatten.
BWD_CONFIG = Config(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=3, persistent=True,
                    tma_store=True)
# The loss-fused forward's matmul + statistics + fp16 store kernel (same shape: 193.3 ms with flatten,
# 200.9 without; 210.7 for the previous cuBLAS-logits design).
LOSS_CONFIG = Config(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=3, group=16, tma_store=True,
                     flatten=True)
# Measured slower on the H200: 4 stages, a subtiled epilogue, warp specialisation (docs/bench_head.md).


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_row(width: int) -> int:
    """Columns allocated for a row of ``width`` elements (a multiple of ``ROW_ALIGN``)."""
    return cdiv(width, ROW_ALIGN) * ROW_ALIGN


def forward_tiles_per_split(t_tiles: int, v_tiles: int, sms: int, lo: int = 4, hi: int = 32) -> int:
    """Vocabulary tiles per forward program, chosen against wave quantization.

    The forward runs t_tiles * cdiv(v_tiles, k) equal programs of k tiles each, so its time goes as
    ceil(programs / sms) * k. A chunk of a few token tiles (the loss-fused path) is otherwise a launch
    of a couple of ragged waves. Ties go to the larger k (fewer partial statistics to merge).
    """

    def cost(k):
        return cdiv(t_tiles * cdiv(v_tiles, k), sms) * k

    return min(range(hi, lo - 1, -1), key=cost)


# Vocabulary tiles per forward program in the batch-invariant mode: the largest ``forward_tiles_per_split``
# considers, which it also picks for large token counts (few partial statistics to merge).
INVARIANT_TILES_PER_SPLIT = 32


def forward_grid(n_tok: int, vocab: int, cfg: Config, sms: int,
                 batch_invariant: bool = False) -> tuple[int, int, int]:
    """(token tiles, vocabulary tiles per split, splits) of one forward launch over [n_tok, vocab].

    The splits cover the vocabulary tiles exactly once; the last split may run a few masked tiles. A token's
    statistics are merged over the splits, so with ``batch_invariant`` the split depends on the vocabulary
    alone (not on the token count, nor on the GPU's SM count).
    """
    t_tiles, v_tiles = cdiv(n_tok, cfg.block_t), cdiv(vocab, cfg.block_v)
    if batch_invariant:
        per_split = min(INVARIANT_TILES_PER_SPLIT, v_tiles)
    else:
        per_split = forward_tiles_per_split(t_tiles, v_tiles, sms)
    return t_tiles, per_split, cdiv(v_tiles, per_split)


def backward_blocks(
    n_tok: int, dim: int, vocab: int, *, need_hidden: bool, chunk_size: int | None = None,
    vocab_block: int = BACKWARD_VOCAB_BLOCK, budget: int = BACKWARD_WORKSPACE_BYTES, elem_bytes: int = 2,
) -> tuple[int, int]:
    """(tokens, vocabulary rows) of one backward block so that its workspace stays within ``budget`` bytes.

    The workspace is the [tokens, padded rows] grad_logits tile plus, when grad_hidden is wanted and the
    vocabulary spans several blocks, an fp32 [tokens, D] grad_hidden accumulator
    (``backward_workspace_bytes``). A caller's ``chunk_size`` overrides the token count.
    """
    rows_v = min(vocab, vocab_block)
    tokens = max(1, budget // backward_workspace_bytes(1, dim, vocab, rows_v, need_hidden, elem_bytes))
    if tokens >= 256:
        tokens -= tokens % 128
    if chunk_size:
        tokens = chunk_size
    return min(tokens, n_tok), rows_v


def backward_workspace_bytes(
    tokens: int, dim: int, vocab: int, rows_v: int, need_hidden: bool, elem_bytes: int = 2
) -> int:
    """Bytes the backward allocates for one block of ``tokens`` x ``rows_v`` (besides the gradients)."""
    accumulator = 4 * dim if need_hidden and rows_v < vocab else 0
    return tokens * (elem_bytes * padded_row(rows_v) + accumulator)


def default_loss_rows(vocab: int, budget: int = FUSED_LOSS_WORKSPACE_BYTES) -> int:
    """Most tokens per chunk of the loss-fused forward: its 16-bit [C, padded V] buffer stays within ``budget``."""
    rows = max(1, budget // (2 * padded_row(vocab)))
    return rows - rows % 128 if rows >= 256 else rows


def loss_chunk_rows(n_tok: int, vocab: int, chunk_size: int | None = None,
                    budget: int = FUSED_LOSS_WORKSPACE_BYTES) -> int:
    """Tokens per chunk of the loss-fused forward: equal chunks of at most ``default_loss_rows`` tokens
    (rounded up to 128-token tiles), so no chunk is a sliver; a caller's ``chunk_size`` wins."""
    if chunk_size:
        return min(chunk_size, n_tok)
    most = default_loss_rows(vocab, budget)
    chunks = cdiv(n_tok, most)
    return min(most, n_tok, cdiv(cdiv(n_tok, chunks), 128) * 128)


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and row strides."""
    for t in tensors:
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True
