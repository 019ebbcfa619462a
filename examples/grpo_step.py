"""One complete GRPO step with actorcore and FSDP2: rollout, old and reference log-probs, group-normalised
advantages, the clipped policy loss with a KL penalty fused into the lm head, an optimizer step.

    python examples/grpo_step.py                 # 2 gloo processes on the CPU, the embedded tiny model
    torchrun --nproc-per-node 2 examples/grpo_step.py --device cuda     # the same step on GPUs (NCCL)

Each data-parallel rank owns different prompts. ``generate`` stands in for the rollout engine (vLLM, SGLang);
the reward is a toy (the share of even token ids in the response) so the step runs anywhere.
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Settings:
    prompts_per_rank: int = 2
    group_size: int = 4          # responses per prompt (the G of GRPO)
    prompt_len: int = 6
    response_len: int = 10
    clip: float = 0.2
    kl_beta: float = 0.04
    lr: float = 1e-3
    seed: int = 0


def grpo_loss(logprob, entropy, advantage, old_logprob, ref_logprob, weight, *, clip, kl_beta):
    """Per-token GRPO loss: clipped importance ratio times the advantage, plus a k3 KL estimate to the
    reference policy; ``weight`` is 1 / (response tokens of the micro-batch) on response tokens, 0 elsewhere."""
    ratio = torch.exp(logprob - old_logprob)
    policy = -torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    log_ref_ratio = ref_logprob - logprob
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    return (policy + kl_beta * kl) * weight


def group_advantages(rewards_PG: torch.Tensor) -> torch.Tensor:
    """GRPO: each response's reward normalised within its prompt's group."""
    mean = rewards_PG.mean(-1, keepdim=True)
    std = rewards_PG.std(-1, keepdim=True)
    return (rewards_PG - mean) / (std + 1e-6)


def rollout(policy, prompts_PL: torch.Tensor, settings: Settings) -> tuple[list[torch.Tensor], int]:
    """Sample ``group_size`` responses per prompt (the global RNG, seeded per rank); returns one id sequence
    (prompt + response) per sample and the prompt length."""
    inputs = prompts_PL.repeat_interleave(settings.group_size, dim=0)
    with torch.no_grad():
        out = policy.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=True, top_k=0,
                              max_new_tokens=settings.response_len, min_new_tokens=settings.response_len,
                              pad_token_id=0)
    return list(out), inputs.shape[1]


def grpo_step(rank: int, world_size: int, settings: Settings = Settings(), device: str = "cpu") -> dict:
    import actorcore as ac
    from actorcore.hf.embedded import build_text_model
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(settings.seed)
    policy = build_text_model(seed=settings.seed).to(device)
    reference = copy.deepcopy(policy).eval()  # the frozen initial policy, for the KL term
    for layer in policy.model.layers:
        fully_shard(layer)
    fully_shard(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.lr)

    # 1. rollout: this rank's prompts, group_size sampled responses each
    torch.manual_seed(settings.seed + 1000 * (rank + 1))
    vocab = policy.config.vocab_size
    prompts = torch.randint(3, vocab, (settings.prompts_per_rank, settings.prompt_len), device=device)
    policy.eval()
    sequences, prompt_len = rollout(policy, prompts, settings)
    policy.reshard()  # the root keeps its parameters gathered after a forward; back to shards
    batch = ac.pack(sequences)

    # 2. rewards and group-normalised advantages, spread over each response's tokens
    responses = torch.stack([s[prompt_len:] for s in sequences])
    rewards = (responses % 2 == 0).float().mean(-1)
    advantages = group_advantages(rewards.view(settings.prompts_per_rank, settings.group_size)).reshape(-1)
    is_response = torch.cat([torch.arange(len(s), device=device) >= prompt_len for s in sequences]).float()
    token_adv = torch.repeat_interleave(advantages, torch.tensor([len(s) for s in sequences], device=device))
    weight = is_response / is_response.sum()

    # 3. old (behaviour) and reference log-probs, no grad
    with torch.no_grad():
        old = ac.compute_logprobs(policy, batch)
        ref = ac.compute_logprobs(reference, batch)
    policy.reshard()

    # 4. the policy loss through the loss-fused head, backward (FSDP2 reduces over ranks), optimizer step
    policy.train()
    before = {n: p.detach().full_tensor().clone() for n, p in policy.named_parameters()}
    out = ac.compute_loss(policy, batch, lambda lp, ent, a, o, r, w: grpo_loss(
        lp, ent, a, o, r, w, clip=settings.clip, kl_beta=settings.kl_beta),
        token_args=(token_adv, old.log_probs, ref.log_probs, weight))
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moved = max((p.detach().full_tensor() - before[n]).abs().max().item() for n, p in policy.named_parameters())
    kl = (torch.exp(ref.log_probs - out.logprob) - (ref.log_probs - out.logprob) - 1)[is_response.bool()].mean()
    return {"loss": out.loss.item(), "mean_reward": rewards.mean().item(), "kl": kl.item(),
            "max_weight_change": moved, "tokens": batch.num_tokens,
            "first_param": next(iter(policy.parameters())).detach().full_tensor()[:2].clone()}


def _worker(rank: int, world_size: int, settings: Settings, device: str) -> dict:
    return grpo_step(rank, world_size, settings, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (gloo, spawned here) or cuda (run under torchrun)")
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn on the CPU")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank = dist.get_rank()
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        results = [grpo_step(rank, dist.get_world_size(), Settings(), args.device)]
        dist.destroy_process_group()
    else:
        from actorcore.parallel.spawn import run_distributed

        results = run_distributed(_worker, args.world_size, args=(Settings(), "cpu"))
    for rank, r in enumerate(results):
        print(f"rank {rank}: loss {r['loss']:+.4f}  mean reward {r['mean_reward']:.3f}  KL {r['kl']:.2e}  "
              f"tokens {r['tokens']}  max weight change {r['max_weight_change']:.2e}")


if __name__ == "__main__":
    main()
