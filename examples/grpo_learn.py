"""GRPO that visibly learns, on the CPU: the embedded tiny Qwen3 learns to answer "a + b =".

Measured (CPU, 2026-12-02): 20 steps at the default learning rate 5e-3 lift the held-out mean reward from
0.007-0.009 to 0.186-0.197 over seeds 0-4, and the batch reward, once up (0.18-0.20 from step 12-18), stays up to
step 20; at 1e-2 the batch reward peaks at 0.20 by step 10-16 and, for seed 0, falls back to 0.07 by step 20 (a KL
spike of 101 nats at step 17). 20 steps take 10-25 s on an idle 2-core machine (the 200-step default was not timed).

    python examples/grpo_learn.py                  # 200 steps, a table, grpo_learn.png (matplotlib if installed)
    python examples/grpo_learn.py --steps 40 --twin  # also check every step against a plain-transformers loop

The loop a trainer runs, with actorcore as the model layer:
1. the rollout engine is a separate copy of the policy (``generate`` stands in for vLLM / SGLang); before every
   rollout its weights are refreshed from the policy through actorcore's export stream and ``load_into``;
2. rewards are verifiable: 1 for the exact sum (its digits, then end-of-sequence), 0.2 for an answer that at least
   starts with a digit, else 0; advantages are normalised within each prompt's group;
3. old and reference log-probs through ``actorcore.compute_logprobs`` on the packed batch (no padding);
4. the clipped, KL-regularised GRPO loss fused into the lm head (``actorcore.compute_loss``), ``updates`` optimizer
   steps per rollout batch (so the clip acts).
``--twin`` runs a plain transformers loop beside it at every step, on the same weights and the same batch
(padded forward, ``log_softmax`` of the logits, the same loss in torch), and records the largest per-token
log-prob difference and the largest gradient difference (relative to each parameter's largest gradient): the
convergence check that actorcore computes exactly what the plain loop computes, step after step of training.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import group_advantages, grpo_loss  # noqa: E402  (the same loss as the one-step example)

PAD, EOS = 0, 1
DIGIT0, PLUS, EQUALS = 3, 13, 14  # token ids: digits 0..9 are 3..12


@dataclass(frozen=True)
class Settings:
    steps: int = 200
    prompts_per_step: int = 8
    group_size: int = 8          # responses per prompt (the G of GRPO)
    max_response: int = 3        # up to two digits and end-of-sequence
    updates: int = 2             # optimizer steps per rollout batch
    clip: float = 0.2
    kl_beta: float = 0.02
    lr: float = 5e-3             # measured: 1e-2 learns faster for ~10 steps, then can collapse
    eval_samples: int = 2        # sampled answers per prompt (all 100 prompts) when evaluating
    seed: int = 0


@dataclass
class History:
    rows: list[dict] = field(default_factory=list)       # one per step: reward, KL, loss, seconds
    twin_max_diff: list[float] = field(default_factory=list)  # per step, |actorcore - plain loop| log-prob
    twin_grad_rel: list[float] = field(default_factory=list)  # per step, gradients, relative to the largest
    reward_before: float = float("nan")
    reward_after: float = float("nan")


def prompt_ids(a: int, b: int) -> list[int]:
    return [DIGIT0 + a, PLUS, DIGIT0 + b, EQUALS]


def answer_ids(a: int, b: int) -> list[int]:
    return [DIGIT0 + int(d) for d in str(a + b)] + [EOS]


def reward(response: list[int], a: int, b: int) -> float:
    if response == answer_ids(a, b):
        return 1.0
    return 0.2 if response and DIGIT0 <= response[0] < DIGIT0 + 10 else 0.0


def sample(model, pairs: list[tuple[int, int]], settings: Settings, generator_seed: int) -> list[list[int]]:
    """Sampled responses (ids up to and including end-of-sequence) for each pair, from ``model.generate``."""
    torch.manual_seed(generator_seed)
    inputs = torch.tensor([prompt_ids(a, b) for a, b in pairs])
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=True, top_k=0, top_p=1.0,
                             max_new_tokens=settings.max_response, eos_token_id=EOS, pad_token_id=PAD)
    responses = []
    for row in out[:, inputs.shape[1]:].tolist():
        responses.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return responses


def evaluate(model, settings: Settings, seed: int) -> float:
    """Mean reward of sampled answers to all 100 prompts (``eval_samples`` each), a fixed sampling seed."""
    pairs = [(a, b) for a in range(10) for b in range(10)] * settings.eval_samples
    return sum(reward(r, a, b) for r, (a, b) in zip(sample(model, pairs, settings, seed), pairs)) / len(pairs)


def refresh_rollout_weights(rollout, policy) -> None:
    """The weight sync of an RL system: the policy's HF-named tensors, streamed in buckets, into the rollout copy."""
    from actorcore import export

    export.load_into(rollout, export.hf_weight_stream(policy, names="model"))


def plain_logprobs(model, sequences: list[torch.Tensor]) -> torch.Tensor:
    """The plain transformers loop: right-padded forward, ``log_softmax`` of the logits; ``[T]`` in packed order,
    0 at each sequence's first token (actorcore's layout)."""
    ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=PAD)
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor([len(s) for s in sequences])[:, None]).long()
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1], -1)
    scored = torch.cat([torch.zeros(ids.shape[0], 1), logp.gather(-1, ids[:, 1:, None])[..., 0]], 1)
    return scored[mask.bool()]


def train(settings: Settings = Settings(), twin: bool = False, progress: bool = True) -> History:
    import actorcore as ac
    from actorcore.hf.embedded import build_text_model
    from tqdm import tqdm

    policy = build_text_model(seed=settings.seed).train()
    reference = copy.deepcopy(policy).eval()   # the frozen initial policy, for the KL term
    rollout = copy.deepcopy(policy).eval()     # the "rollout engine": weights refreshed every step
    optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.lr, weight_decay=0.0)
    history = History(reward_before=evaluate(policy.eval(), settings, seed=10_000))
    policy.train()
    g = torch.Generator().manual_seed(settings.seed)
    for step in tqdm(range(settings.steps), desc="GRPO", disable=not progress):
        start = time.perf_counter()
        refresh_rollout_weights(rollout, policy)
        pairs = [tuple(torch.randint(0, 10, (2,), generator=g).tolist()) for _ in range(settings.prompts_per_step)]
        pairs = [p for p in pairs for _ in range(settings.group_size)]
        responses = sample(rollout, pairs, settings, generator_seed=settings.seed * 100_003 + step)
        rewards = torch.tensor([reward(r, a, b) for r, (a, b) in zip(responses, pairs)])
        sequences = [torch.tensor(prompt_ids(a, b) + r) for r, (a, b) in zip(responses, pairs)]
        batch = ac.pack(sequences)
        adv = group_advantages(rewards.view(settings.prompts_per_step, settings.group_size)).reshape(-1)
        lengths = torch.tensor([len(s) for s in sequences])
        is_response = torch.cat([torch.arange(len(s)) >= 4 for s in sequences]).float()
        token_args = (torch.repeat_interleave(adv, lengths), None, None, is_response / is_response.sum())
        with torch.no_grad():
            old = ac.compute_logprobs(policy, batch, entropy=False).log_probs
            ref = ac.compute_logprobs(reference, batch, entropy=False).log_probs
            if twin:
                history.twin_max_diff.append((plain_logprobs(policy, sequences) - old)[is_response.bool()]
                                             .abs().max().item())
        token_args = (token_args[0], old, ref, token_args[3])
        for update in range(settings.updates):
            out = ac.compute_loss(policy, batch, lambda lp, ent, a, o, r, w: grpo_loss(
                lp, ent, a, o, r, w, clip=settings.clip, kl_beta=settings.kl_beta), token_args=token_args)
            out.loss.backward()
            if twin and update == 0:
                history.twin_grad_rel.append(_plain_gradient_difference(policy, sequences, token_args, settings))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        kl = torch.exp(ref - out.logprob) - (ref - out.logprob) - 1
        history.rows.append({"step": step + 1, "reward": rewards.mean().item(),
                             "kl": kl[is_response.bool()].mean().item(), "loss": out.loss.item(),
                             "seconds": time.perf_counter() - start})
    history.reward_after = evaluate(policy.eval(), settings, seed=10_000)
    return history


def _plain_gradient_difference(model, sequences, token_args, settings: Settings) -> float:
    """The plain loop's gradient of the same loss on the same weights, against the one ``model`` holds (kept)."""
    ours = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    adv, old, ref, weight = token_args
    lp = plain_logprobs(model, sequences)
    grpo_loss(lp, None, adv, old, ref, weight, clip=settings.clip, kl_beta=settings.kl_beta).sum().backward()
    worst = 0.0
    for n, p in model.named_parameters():
        scale = p.grad.abs().max().clamp(min=1e-30)
        worst = max(worst, ((ours[n] - p.grad).abs().max() / scale).item())
        p.grad = ours[n]
    return worst


def write_curve(history: History, path: Path) -> str:
    """The reward curve as a PNG (atomic: temp name + rename); a message instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG written (pip install matplotlib)"
    steps = [r["step"] for r in history.rows]
    rewards = [r["reward"] for r in history.rows]
    window = max(1, len(rewards) // 20)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(steps, rewards, color="0.75", lw=0.8, label="batch mean")
    ax.plot(steps, smooth, color="C0", lw=2, label=f"running mean ({window} steps)")
    ax.axhline(history.reward_before, color="C3", ls="--", lw=1, label=f"untrained {history.reward_before:.2f}")
    ax.axhline(history.reward_after, color="C2", ls="--", lw=1, label=f"trained {history.reward_after:.2f}")
    ax.set(xlabel="GRPO step", ylabel="mean reward", title="embedded tiny Qwen3 learns a + b (CPU)", ylim=(0, 1))
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return f"reward curve written to {path}"


def table(history: History, every: int) -> str:
    lines = ["  step  reward      KL     loss   s/step"]
    for r in history.rows:
        if r["step"] % every == 0 or r["step"] == 1:
            lines.append(f"{r['step']:6d}  {r['reward']:6.3f}  {r['kl']:.1e}  {r['loss']:+.4f}  {r['seconds']:6.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--twin", action="store_true", help="also train a plain-transformers twin, compare per token")
    parser.add_argument("--png", type=Path, default=Path("grpo_learn.png"))
    args = parser.parse_args()
    settings = Settings(steps=args.steps, seed=args.seed)
    history = train(settings, twin=args.twin)
    print(table(history, every=max(1, settings.steps // 10)))
    print(f"mean reward on all 100 prompts: untrained {history.reward_before:.3f} -> trained "
          f"{history.reward_after:.3f}   ({asdict(settings)})")
    if args.twin:
        print(f"actorcore vs plain transformers loop over all steps: log-probs max |diff| "
              f"{max(history.twin_max_diff):.2e}, gradients max relative diff {max(history.twin_grad_rel):.2e}")
    print(write_curve(history, args.png))


if __name__ == "__main__":
    main()
