"""The VLM row of ``actorcore demo``: packed Qwen2.5-VL log-probs against the model's own forward.

The embedded tiny Qwen2.5-VL (``actorcore.hf.embedded``, no downloads) scores a batch of an image sequence, a
video sequence and a text-only sequence, packed with M-RoPE position ids from the model's own rope-index
function; ``actorcore.verify`` compares it per token with the model's forward, one sequence at a time.
"""

from __future__ import annotations

import torch

from actorcore.cli.demo_sp import timed


def vlm_row(seed: int) -> dict:
    """The verify report of packed ``compute_logprobs`` vs the model's own forward, and the packed time (warm)."""
    import actorcore as ac
    from actorcore.hf.embedded import VLM_MODEL_TYPE, build_vlm, synthetic_sample

    model = build_vlm(seed=seed)
    g = torch.Generator().manual_seed(seed)
    samples = [
        synthetic_sample(model, images=[(4, 6)], text_lengths=(9, 14), generator=g),
        synthetic_sample(model, video=(2, 4, 4), text_lengths=(6, 11), generator=g),
        synthetic_sample(model, text_lengths=(23,), generator=g),
    ]
    batch = ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=model)
    _, seconds = timed(lambda: ac.compute_logprobs(model, batch))
    report = ac.verify(model, batch)
    return {
        "path": f"{VLM_MODEL_TYPE} packed (1 image seq + 1 video seq + text)",
        "sequences": len(samples),
        "tokens": batch.num_tokens,
        "max_abs_diff_logprob": report.max_abs_diff_logprob,
        "max_abs_diff_entropy": report.max_abs_diff_entropy,
        "tolerance": report.tolerance,
        "seconds": seconds,
    }
