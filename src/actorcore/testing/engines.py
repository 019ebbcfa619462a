"""Test support for the engine tier (``tests/engines``): tiny models vLLM's CPU build runs, an in-process engine from
a saved copy, a training step that changes every weight, and the engine's sampled tokens with their log-probs.

vLLM's CPU attention has no head dim 16 (the tiny configs' default): the engine families take head dim 32, set
through ``head_dim`` where the config has it and through a hidden size of 128 where it derives it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from actorcore.testing.tiny_configs import build_tiny_model

# model_type -> (overrides of the tiny config, what it covers). Agreement with actorcore is exact (float32 rounding).
ENGINE_FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3": (dict(head_dim=32), "dense, q/k norms"),
    "qwen2": (dict(hidden_size=128, tie_word_embeddings=True), "tied lm-head (Qwen2.5's small sizes), qkv biases"),
    "llama": (dict(head_dim=32), "the baseline dense model"),
    "mistral": (dict(head_dim=32), "sliding window"),
    "gemma2": (dict(head_dim=32, query_pre_attn_scalar=32), "tied head, final and attention softcaps, GeGLU"),
    "gemma3_text": (dict(head_dim=32, query_pre_attn_scalar=32), "sliding / full layers, softcaps, tied head"),
    "phi3": (dict(hidden_size=128), "fused qkv and gate/up in the checkpoint"),
    "granite": (dict(hidden_size=128), "embedding / residual / attention multipliers, logits scaling"),
    "qwen3_moe": (dict(head_dim=32), "MoE (stacked experts in transformers 5, per-expert names in the checkpoint)"),
    "qwen2_moe": (dict(hidden_size=128), "MoE with a gated shared expert"),
    "mixtral": (dict(head_dim=32), "MoE, every layer"),
    "glm4_moe": (dict(head_dim=32), "MoE with grouped routing, a shared expert and a correction bias"),
}

# Families vLLM's CPU build runs whose own implementation disagrees with transformers' beyond float32 rounding
# (measured max |d log-p| on the probe before any update; it grows as training moves the weights): the bridge is
# exact for them against a fresh engine started from the trainer's saved weights, not against actorcore.
# model_type -> (overrides, measured disagreement, why).
ENGINE_DIFFERENT_IMPLEMENTATIONS: dict[str, tuple[dict[str, Any], float, str]] = {
    "deepseek_v3": (dict(topk_method="noaux_tc", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128, head_dim=64), 7.1e-4,
                    "the CPU MLA kernel takes only kv_lora_rank 512 + rope 64; vLLM's MLA differs by 7e-4"),
    "apertus": (dict(head_dim=32), 4.5e-5, "vLLM's xIELU activation differs by 4.5e-5, more once trained"),
}

# Families vLLM's CPU build runs that its reload protocol cannot update: the bridge refuses the update loudly.
# model_type -> (overrides, why).
ENGINE_NOT_UPDATABLE: dict[str, tuple[dict[str, Any], str]] = {
    "gpt_oss": (dict(head_dim=32, intermediate_size=96),
                "vLLM 0.32's gpt-oss loader copies the experts and the attention sinks into their parameters directly, "
                "past the weight loaders its reload protocol tracks, so an update leaves them old"),
}

KV_CACHE_BYTES = 32 << 20  # per engine: the tests' prompts are short, and several engines share one process


def engine_model(model_type: str, overrides: dict[str, Any], seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    model = build_tiny_model(model_type, seed=seed, dtype=dtype, **overrides)
    model.train()
    return model


def save_for_engine(model: torch.nn.Module, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def start_engine(directory: str, dtype: str = "float32", **kwargs: Any) -> Any:
    """An ``LLM`` on the saved model: no tokenizer (prompts are token ids), eager, processed log-probs (the sampling
    temperature applied, what actorcore's ``temperature`` computes)."""
    from vllm import LLM

    options = dict(dtype=dtype, enforce_eager=True, max_model_len=256, skip_tokenizer_init=True, seed=0,
                   logprobs_mode="processed_logprobs", kv_cache_memory_bytes=KV_CACHE_BYTES)
    if dtype == "float32" and _uses_mla(directory):
        # On a CPU with AMX vLLM prefers its AMX MLA kernel, which takes 16-bit weights only: the reference one
        options["attention_backend"] = "CPU_MLA"
    options.update(kwargs)
    return LLM(model=directory, **options)


def _uses_mla(directory: str) -> bool:
    """Whether the saved model's attention is multi-head latent attention (a ``kv_lora_rank`` in its config)."""
    with open(os.path.join(directory, "config.json")) as f:
        return bool(json.load(f).get("kv_lora_rank"))


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int, vocab: int = 131) -> float:
    """One optimizer step on a policy-gradient-shaped loss over random sequences: every weight moves."""
    import actorcore as ac

    generator = torch.Generator().manual_seed(seed)
    lengths = [9, 14, 6]
    batch = ac.pack([torch.randint(0, vocab, (n,), generator=generator) for n in lengths])
    advantages = torch.randn(batch.num_tokens, generator=generator)
    loss = -(ac.compute_logprobs(model, batch, entropy=False).log_probs * advantages).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


PROMPTS = [[3, 5, 9, 4, 11, 17, 2, 8], [7, 3, 8, 9, 10], [12, 1, 1, 40, 33, 7, 90, 21, 5, 5, 64, 100]]


def sample(llm: Any, prompts: list[list[int]], temperature: float, seed: int, max_tokens: int = 8
           ) -> tuple[list[list[int]], list[list[float]]]:
    """The engine's completions of ``prompts`` and the log-probs it reports for each sampled token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, detokenize=False, seed=seed,
                            ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    log_probs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outputs]
    return completions, log_probs


def assert_agrees(model: torch.nn.Module, llm: Any, temperature: float, seed: int, atol: float) -> None:
    """The engine's log-probs of tokens it samples now equal actorcore's on ``model``, per token."""
    from actorcore.engines import rollout_agreement

    completions, engine_lp = sample(llm, PROMPTS, temperature, seed)
    agreement = rollout_agreement(model, PROMPTS, completions, engine_lp, temperature=temperature)
    for trainer, engine in zip(agreement.log_probs, agreement.engine_log_probs):
        torch.testing.assert_close(trainer, engine, atol=atol, rtol=0)
    assert agreement.tokens == sum(len(c) for c in completions) > 0


def train_and_update(model: torch.nn.Module, llm: Any, bridge: Any, updates: int, atol: float,
                     stream_options: dict[str, Any] | None = None) -> list[Any]:
    """``updates`` times: an optimizer step that moves every weight, ``bridge.update``, and the sampled tokens'
    agreement at temperature 1.0 and 0.7. Returns the bridge's reports."""
    from actorcore.export import hf_weight_stream

    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    reports = []
    for step in range(1, updates + 1):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        training_step(model, optimizer, seed=step)
        assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "a weight did not move"
        reports.append(bridge.update(hf_weight_stream(model, **(stream_options or {})), reference=model))
        assert reports[-1].probe.ok and reports[-1].probe.max_abs <= atol
        for temperature in (1.0, 0.7):
            assert_agrees(model, llm, temperature, 10 * step, atol)
    return reports
