"""CPU: packed causal attention keeps sequences apart, and its ``trace`` names the backend that ran.

Legend: ``T`` packed tokens, ``N`` query heads, ``K`` key/value heads, ``H`` head dim.
"""

from collections import Counter

import torch

from actorcore.kernels.attention.varlen import varlen_causal_attention
from actorcore.testing.tolerances import TOL


def test_packed_equals_each_sequence_alone_and_trace_counts_the_backend():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 6]
    q_TNH, k_TKH, v_TKH = (torch.randn(sum(lengths), heads, 8, generator=g) for heads in (4, 2, 2))
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    trace = Counter()
    out = varlen_causal_attention(q_TNH, k_TKH, v_TKH, cu, max(lengths), trace=trace)
    assert trace == {"varlen_attention:segments": 1}  # "auto" on the CPU
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = varlen_causal_attention(q_TNH[start:end], k_TKH[start:end], v_TKH[start:end],
                                        torch.tensor([0, end - start]), end - start, trace=trace)
        assert torch.equal(out[start:end], alone)
    assert trace == {"varlen_attention:segments": 1 + len(lengths)}


def _attention_with_sinks(q_LNH, k_LKH, v_LKH, sinks_N, scale):
    """Plain torch, one sequence: softmax over [scores, sink] per head, the sink column dropped."""
    groups = q_LNH.shape[1] // k_LKH.shape[1]
    k_LNH, v_LNH = k_LKH.repeat_interleave(groups, 1), v_LKH.repeat_interleave(groups, 1)
    scores_NLL = torch.einsum("inh,jnh->nij", q_LNH, k_LNH) * scale
    length = q_LNH.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores_NLL = scores_NLL.masked_fill(~causal, float("-inf"))
    sink_NL1 = sinks_N[:, None, None].expand(-1, length, 1)
    probs_NLL = torch.softmax(torch.cat([scores_NLL, sink_NL1], -1), -1)[..., :-1]
    return torch.einsum("nij,jnh->inh", probs_NLL, v_LNH)


def test_attention_sinks_per_sequence_and_refused_elsewhere():
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 7]
    q_TNH, k_TKH, v_TKH = (torch.randn(sum(lengths), heads, 8, generator=g, dtype=torch.float64)
                           for heads in (4, 2, 2))
    sinks_N = torch.randn(4, generator=g, dtype=torch.float64) * 2
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    trace = Counter()
    out = varlen_causal_attention(q_TNH, k_TKH, v_TKH, cu, 7, scale=0.3, sinks=sinks_N, trace=trace)
    assert trace == {"varlen_attention:segments": 1}
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = _attention_with_sinks(q_TNH[start:end], k_TKH[start:end], v_TKH[start:end], sinks_N, 0.3)
        torch.testing.assert_close(out[start:end], want, rtol=0, atol=TOL["attention_fp64_vs_plain"])
    plain = varlen_causal_attention(q_TNH, k_TKH, v_TKH, cu, 7, scale=0.3)
    assert (plain - out).abs().max() > TOL["attention_changed_at_least"]  # the sinks changed the result
    import pytest

    with pytest.raises(ValueError, match="cannot apply attention sinks"):
        varlen_causal_attention(q_TNH, k_TKH, v_TKH, cu, 7, sinks=sinks_N, backend="torch_varlen")
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
        varlen_causal_attention(q_TNH, k_TKH, v_TKH, cu, 7, sinks=sinks_N[:2])


def test_unequal_head_dims_are_padded_exactly():
    """Flash kernels take one head dim for q, k and v; latent attention (DeepSeek-V3) gives v its own. The padding
    that makes them equal changes no output (both directions: v narrower and v wider than q / k)."""
    from actorcore.kernels.attention.varlen import _with_equal_head_dims

    g = torch.Generator().manual_seed(1)
    lengths = [4, 2, 5]
    cu = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    for qk_dim, v_dim in ((12, 8), (8, 12)):
        q, k = (torch.randn(sum(lengths), heads, qk_dim, generator=g, dtype=torch.float64) for heads in (4, 2))
        v = torch.randn(sum(lengths), 2, v_dim, generator=g, dtype=torch.float64)
        want = varlen_causal_attention(q, k, v, cu, 5, scale=0.3, backend="segments")
        seen = []

        def attend(q_, k_, v_):
            seen.append((q_.shape[-1], k_.shape[-1], v_.shape[-1]))
            return varlen_causal_attention(q_, k_, v_, cu, 5, scale=0.3, backend="segments")

        got = _with_equal_head_dims(q, k, v, attend)
        assert seen == [(max(qk_dim, v_dim),) * 3] and got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-12
