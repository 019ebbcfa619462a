"""examples/grpo_step.py runs a whole GRPO step under FSDP2 on 2 gloo ranks (the README's example)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from actorcore.testing.distributed import run_distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_step.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("grpo_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_step"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _worker(rank, world_size):
    example = _load_example()
    return example.grpo_step(rank, world_size, example.Settings(), "cpu")


@pytest.mark.dist
def test_grpo_step_under_fsdp2():
    results = run_distributed(_worker, 2)
    for r in results:
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert r["kl"] == 0.0  # step one: the policy that is scored is the reference policy
        assert r["max_weight_change"] > 0
    # FSDP2 reduced the gradients over both ranks' data: the updated weights agree
    assert torch.equal(results[0]["first_param"], results[1]["first_param"])


def test_grpo_loss_is_token_wise_and_clips():
    example = _load_example()
    lp = torch.tensor([-1.0, -1.0]).requires_grad_()
    old = torch.tensor([-1.5, -1.0])  # ratio e^0.5 > 1.2 on the first token: clipped, no gradient there
    loss = example.grpo_loss(lp, None, torch.tensor([1.0, 1.0]), old, lp.detach(), torch.tensor([0.5, 0.5]),
                             clip=0.2, kl_beta=0.0)
    loss.sum().backward()
    assert lp.grad[0] == 0 and lp.grad[1] != 0
