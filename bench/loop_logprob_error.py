"""Per-token log-prob error of what each loop computed before, and of actorcore in its place (CPU is enough).

Three rollout batches (TRL seeds 0-2) of TRL's own GRPOTrainer on the tiny Qwen2 of the TRL tests (left-padded
prompts, right-padded completions; the completion tokens are scored). The reference is the same weights in fp32,
TRL's own method, no autocast (actorcore's fp32 path equals it to 1e-5: tests/unit/test_compat_trl.py). Rows,
each the largest |log-prob - reference| over the completion tokens:

- TRL 1.16, ``bf16=True`` (bf16 autocast over fp32 weights, TRL's chunked fused head), with and without
  ``cast_lm_head_to_fp32``; the same trainer patched by ``actorcore.compat.trl.patch_trainer``;
- a plain PyTorch loop on bf16 weights: ``log_softmax`` of the model's own bf16 logits; actorcore's
  ``compute_logprobs_padded`` on the same bf16 weights;
- verl 0.9.1's torch fused head (``use_fused_kernels=True``, copied in bench/_verl_head.py: bf16 logits per
  chunk, then fp32 softmax) on the decoder's bf16 hidden states.

    PYTHONPATH=src python bench/loop_logprob_error.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _verl_head import verl_fused_linear_for_ppo  # noqa: E402

import actorcore as ac  # noqa: E402
from actorcore.compat.trl import patch_trainer  # noqa: E402
from actorcore.testing.trl_cases import build_trainer, rollout, tiny_policy, trl_own  # noqa: E402


def _err(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    return (got.float() - want)[mask.bool()].abs().max().item()


def measure(seed: int) -> tuple[list[tuple[str, float]], int, int, float]:
    """The rows for the rollout batch of TRL seed ``seed``; also (completion tokens, rows, temperature)."""
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp32 = build_trainer(tmp / "fp32", seed=seed)
        ids, mask, keep = rollout(fp32)
        completion = mask[:, -keep:]
        with torch.no_grad():
            want, _, _ = trl_own(fp32, fp32.model, ids, mask, keep)
            rows = []
            for cast in (False, True):
                trainer = build_trainer(tmp / f"bf16_{cast}", model=tiny_policy(tmp / "model_bf16"), bf16=True,
                                        cast_lm_head_to_fp32=cast, seed=seed)
                got, _, _ = trl_own(trainer, trainer.model, ids, mask, keep)
                rows.append((f"TRL bf16=True, cast_lm_head_to_fp32={cast}", _err(got, want, completion)))
            patch_trainer(trainer)
            got, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
            rows.append(("TRL bf16=True + actorcore.compat.trl.patch_trainer", _err(got, want, completion)))

            temperature = fp32.temperature
            bf16 = tiny_policy(tmp / "plain", save=False).to(torch.bfloat16)
            logits = bf16(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1] / temperature
            plain = torch.log_softmax(logits, -1).gather(-1, ids[:, -keep:, None])[..., 0]
            rows.append(("plain loop, bf16 weights: log_softmax(model(ids).logits)", _err(plain, want, completion)))
            hidden = bf16.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -keep - 1:-1]
            verl, _ = verl_fused_linear_for_ppo(hidden.reshape(-1, hidden.shape[-1]), bf16.lm_head.weight,
                                                ids[:, -keep:].reshape(-1), temperature)
            rows.append(("verl 0.9.1 torch fused head, bf16 weights", _err(verl.view(plain.shape), want, completion)))
            ours = ac.compute_logprobs_padded(bf16, ids, mask, temperature=temperature, entropy=False).log_probs
            rows.append(("actorcore.compute_logprobs_padded, bf16 weights",
                         _err(ours[:, -keep:], want, completion)))
    return rows, int(completion.sum()), ids.shape[0], temperature


def main() -> None:
    results = [measure(seed) for seed in (0, 1, 2)]
    tokens = sum(r[1] for r in results)
    print(f"tiny Qwen2 (hidden 64, 2 layers, vocab 131), TRL seeds 0-2: {tokens} completion tokens in "
          f"{sum(r[2] for r in results)} rows, temperature {results[0][3]}; max |log-prob - fp32 reference| per token "
          "(per seed, then the largest):")
    for i, (name, _) in enumerate(results[0][0]):
        values = [r[0][i][1] for r in results]
        print(f"  {name:60s} {'  '.join(f'{v:.2e}' for v in values)}   max {max(values):.2e}")


if __name__ == "__main__":
    main()
