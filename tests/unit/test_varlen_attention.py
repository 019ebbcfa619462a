"""CPU: packed causal attention keeps sequences apart, and its ``trace`` names the backend that ran.

Legend: ``T`` packed tokens, ``N`` query heads, ``K`` key/value heads, ``H`` head dim.
"""

from collections import Counter

import torch

from actorcore.kernels.varlen_attention import varlen_causal_attention


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
