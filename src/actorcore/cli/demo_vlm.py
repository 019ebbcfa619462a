"""The VLM row of ``actorcore demo``: packed Qwen2.5-VL log-probs against the plain padded HF forward.

A tiny seeded Qwen2.5-VL (no downloads) scores a batch of an image sequence, a video sequence and a
text-only sequence, packed with M-RoPE position ids from the model's own rope-index function.
"""

from __future__ import annotations

import time

import torch

MODEL_TYPE = "qwen2_5_vl"


def vlm_row(seed: int) -> dict:
    """Max per-token differences of packed ``compute_logprobs`` vs the HF padded forward, and the packed time."""
    import actorcore as ac
    from actorcore.testing.reference_vlm import reference_logprobs_vlm
    from actorcore.testing.tiny_vlm import build_tiny_vlm, synthetic_sample
    from actorcore.vlm_batch import pack_multimodal

    model = build_tiny_vlm(MODEL_TYPE, seed=seed)
    g = torch.Generator().manual_seed(seed)
    samples = [
        synthetic_sample(model, images=[(4, 6)], text_lengths=(9, 14), generator=g),
        synthetic_sample(model, video=(2, 4, 4), text_lengths=(6, 11), generator=g),
        synthetic_sample(model, text_lengths=(23,), generator=g),
    ]
    batch = pack_multimodal(model, [s.input_ids for s in samples], [s.multimodal for s in samples])
    with torch.no_grad():
        ac.compute_logprobs(model, batch)  # warm-up
        start = time.perf_counter()
        out = ac.compute_logprobs(model, batch)
        seconds = time.perf_counter() - start
        ref_lp, ref_ent = reference_logprobs_vlm(model, samples)
    return {
        "path": f"{MODEL_TYPE} packed (1 image seq + 1 video seq + text)",
        "sequences": len(samples),
        "tokens": batch.num_tokens,
        "max_abs_diff_logprob": (out.log_probs - ref_lp).abs().max().item(),
        "max_abs_diff_entropy": (out.entropy - ref_ent).abs().max().item(),
        "seconds": seconds,
    }
