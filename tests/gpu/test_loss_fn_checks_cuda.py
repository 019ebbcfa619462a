"""CUDA / Triton loss-fused head: the same loss_fn diagnoses as on the CPU (``tests/unit/test_logprob_loss.py``).

Skipped without CUDA or triton."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from actorcore.kernels.logprob import linear_logprob_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LOSSES = {
    "detached": (lambda lp, ent, adv: lp.detach() * adv, "does not depend on the log-probs or entropies"),
    "in place": (lambda lp, ent, adv: lp.mul_(adv), r"modifies its inputs in place \(the log-probs\)"),
    "writes into token_args": (lambda lp, ent, adv: lp * adv.mul_(2.0), r"in place \(token_args\[0\]\)"),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_triton_loss_fused_head_refuses_what_plain_autograd_would_get_wrong(name):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    hidden_TD = torch.randn(200, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    weight_VD = (torch.randn(1031, 64, generator=g) / 8).to("cuda", torch.bfloat16)
    labels_T = torch.randint(0, 1031, (200,), generator=g).cuda()
    advantages_T = torch.randn(200, generator=g).cuda()
    before = advantages_T.clone()
    loss_fn, match = LOSSES[name]
    trace = Counter()
    with pytest.raises(ValueError, match=match):
        linear_logprob_loss(hidden_TD, weight_VD, labels_T, loss_fn, token_args=(advantages_T,), backend="triton",
                            trace=trace)
    assert trace["logprob:triton_fused_loss"] >= 1  # the Triton path was the one that refused
    assert torch.equal(advantages_T, before)
