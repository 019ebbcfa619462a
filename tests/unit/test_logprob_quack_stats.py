"""CPU tests of the arithmetic around the quack statistics epilogue (``kernels.logprob.quack_stats``): the
epilogue's per-(row, tile) outputs in log2 units turned into the head's statistics and the stored z - m.

The epilogue itself runs only on an sm90 GPU (tests/gpu/test_logprob_quack_cuda.py); here a stand-in computes
what quack documents for its parts: ``MaxLog2(round_to_int=False)`` gives k = log2(e) * max(acc) per row and tile,
``ColVecReduce`` sums the returned value over each tile's columns per row (``scaled=True``: the product of the two
returned factors), ``ColVecSelect`` takes the accumulator at the row's target column, and ``D`` is stored in the
output's dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from actorcore.kernels.logprob._common import finish_stats, merge_partial_stats
from actorcore.kernels.logprob.quack_stats import TILE_N, quack_stats_refusal, tile_partials
from actorcore.testing.tolerances import TOL


def _epilogue_stand_in(acc_CV, labels_C, inv_t):
    """The epilogue's outputs from fp32 accumulators (what ``_stats_epilogue`` asks quack for), by its formula."""
    log2e, ln2 = 1.0 / math.log(2.0), math.log(2.0)
    tiles = acc_CV.unflatten(1, (-1, TILE_N))
    k_CN = tiles.amax(-1) * log2e
    shifted2 = (tiles * log2e - k_CN[..., None]) * inv_t
    e = torch.exp2(shifted2)
    shifted = shifted2 * ln2
    d_CV = shifted.flatten(1).to(torch.float16)
    return d_CV, k_CN, e.sum(-1), (shifted * e).sum(-1), acc_CV.gather(1, labels_C[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_tile_partials_give_the_fp64_statistics_per_token(temperature):
    g = torch.Generator().manual_seed(0)
    acc_CV = torch.randn(37, 5 * TILE_N, generator=g) * 6.0  # fp32 accumulators: logits before the temperature
    acc_CV[3] += torch.linspace(0, 40, acc_CV.shape[1])  # one row with a steep, tile-to-tile rising maximum
    labels_C = torch.randint(0, acc_CV.shape[1], (37,), generator=g)
    inv_t = 1.0 / temperature
    d_CV, k_CN, s_CN, a_CN, zy_C = _epilogue_stand_in(acc_CV, labels_C, inv_t)
    shift_CN = torch.empty_like(k_CN)
    lse, logprob, entropy = finish_stats(*merge_partial_stats(*tile_partials(k_CN, s_CN, a_CN, zy_C, inv_t,
                                                                            shift_CN)))

    z = acc_CV.double() * inv_t
    logp = torch.log_softmax(z, -1)
    tol = TOL["logprob_fp32_stats_vs_fp64"]
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), atol=tol, rtol=0)
    torch.testing.assert_close(logprob.double(), logp.gather(1, labels_C[:, None]).squeeze(1), atol=tol, rtol=0)
    torch.testing.assert_close(entropy.double(), -(logp.exp() * logp).sum(-1), atol=tol, rtol=0)
    # what the grad_logits pass reads back: z = stored (z - m) + m of the element's tile, to fp16's rounding
    m_CV = shift_CN.repeat_interleave(TILE_N, dim=1).double()
    rebuilt = d_CV.double() + m_CV
    assert ((rebuilt - z).abs() <= z.sub(m_CV).abs() * 2.0**-11 + m_CV.abs() * 2.0**-21).all()
    assert (shift_CN.double() - z.unflatten(1, (-1, TILE_N)).amax(-1)).abs().max() < 1e-5


def test_without_entropy_no_entropy_is_returned():
    """As the Triton kernel: a loss without entropy gets None for it, not a value it did not ask for."""
    g = torch.Generator().manual_seed(1)
    acc_CV = torch.randn(5, 2 * TILE_N, generator=g)
    labels_C = torch.randint(0, acc_CV.shape[1], (5,), generator=g)
    d_CV, k_CN, s_CN, a_CN, zy_C = _epilogue_stand_in(acc_CV, labels_C, 1.0)
    parts = tile_partials(k_CN, s_CN, a_CN, zy_C, 1.0, torch.empty_like(k_CN), entropy=False)
    assert parts[2] is None
    lse, logprob, entropy = finish_stats(*merge_partial_stats(*parts))
    assert entropy is None
    torch.testing.assert_close(lse.double(), torch.logsumexp(acc_CV.double(), -1),
                               atol=TOL["logprob_fp32_stats_vs_fp64"], rtol=0)


def _tensors(vocab=4 * TILE_N, dim=64, dtype=torch.bfloat16):
    return torch.zeros(8, dim, dtype=dtype), torch.zeros(vocab, dim, dtype=dtype)


@pytest.mark.parametrize("case,expected", [
    (dict(softcap=30.0), "softcap"),
    (dict(batch_invariant=True), "batch-invariant"),
    (dict(dtype=torch.float16), "bf16"),
    (dict(vocab=4 * TILE_N + 8), "not a multiple of 128"),
    (dict(dim=60), "16-byte"),
    (dict(), "sm90"),  # a CPU tensor: everything else fits
])
def test_refusals_say_why(case, expected):
    h, w = _tensors(case.get("vocab", 4 * TILE_N), case.get("dim", 64), case.get("dtype", torch.bfloat16))
    why = quack_stats_refusal(h, w, case.get("softcap"), case.get("batch_invariant", False))
    assert why is not None and expected in why


def test_transposed_weight_is_refused():
    h, w = _tensors()
    assert "16-byte" in quack_stats_refusal(h, w.t().contiguous().t(), None, False)
