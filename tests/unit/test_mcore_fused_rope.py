"""The compiled layers' RoPE (``mcore/build/fused_rope.py``) per element against Megatron's own eager RoPE for packed
(THD) batches (``rope_utils.apply_rotary_pos_emb``): ragged packs with 1-token sequences, partial rotary width, a
YaRN scale, per-token (M-RoPE-shaped) frequencies; gradients of q and k too. Compiled on the CPU (Inductor's C++)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from actorcore.mcore.build.fused_ops import compiled, rotary  # noqa: E402
from actorcore.mcore.build.fused_rope import RopeCache, RopeRequest  # noqa: E402
from actorcore.testing.tolerances import TOL  # noqa: E402

LENGTHS = (5, 1, 9, 1, 3)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class _OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _megatron_rope(t: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor, mscale: float) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    return apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, mscale=mscale, cp_group=_OneRank())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_width,per_token,mscale", [(16, False, 1.0), (8, False, 1.0), (16, True, 1.0),
                                                          (16, False, 1.3)])
def test_fused_rope_matches_megatron_per_element(dtype, rotary_width, per_token, mscale):
    gen = torch.Generator().manual_seed(rotary_width + int(per_token) + int(10 * mscale))
    tokens = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    rows = tokens if per_token else max(LENGTHS)
    freqs = torch.rand(rows, 1, 1, rotary_width, generator=gen) * 40
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype).requires_grad_()
    grad_q, grad_k = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)

    want_q, want_k = _megatron_rope(q, freqs, cu, mscale), _megatron_rope(k, freqs, cu, mscale)
    want = torch.autograd.grad((want_q, want_k), (q, k), (grad_q, grad_k))
    cache = RopeCache()
    angles = cache.angles(RopeRequest(freqs, mscale), cu, tokens, dtype)
    assert cache.angles(RopeRequest(freqs, mscale), cu, tokens, dtype) is angles  # made once per micro-batch
    got_q, got_k = compiled(rotary)(q, k, angles.cos, angles.sin)
    got = torch.autograd.grad((got_q, got_k), (q, k), (grad_q, grad_k))

    tol = TOL["fused_rope_vs_megatron"][dtype]
    for name, a, b in (("q", got_q, want_q), ("k", got_k, want_k), ("dq", got[0], want[0]), ("dk", got[1], want[1])):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, name
        worst = (a.float() - b.float()).abs().max().item()
        assert worst <= tol, f"{name}: {worst:.3e} from Megatron's RoPE"
