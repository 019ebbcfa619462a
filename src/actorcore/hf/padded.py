"""The call shape of TRL-style trainers, which hold ``[B, S]`` tensors: results come back in the input's grid.

``compute_logprobs_padded(model, input_ids, attention_mask)`` packs the rows (left or right padding), runs
``compute_logprobs`` and puts the ``[T]`` results back where their tokens were: ``out.log_probs[b, s]`` is the
log-prob of ``input_ids[b, s]``, 0 at padding and at each row's first real token. Per-token arguments held in
the grid (advantages, old log-probs, masks) reach ``compute_loss`` through ``actorcore.batch.grid_to_packed``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from actorcore.batch import packed_to_grid
from actorcore.hf.logprobs import compute_logprobs
from actorcore.hf.packing import pack_padded
from actorcore.outputs import LogProbOutput


def compute_logprobs_padded(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                            temperature: float = 1.0, entropy: bool = True, parallel: Any = None,
                            trace: Counter | None = None, batch_invariant: bool = False,
                            **multimodal: Any) -> LogProbOutput:
    """``compute_logprobs`` on a padded ``[B, S]`` batch, with ``[B, S]`` float32 results in its layout.

    VLMs: pass the processor's other outputs (``pixel_values``, ``image_grid_thw``, ...) as keywords.
    """
    batch = pack_padded(input_ids, attention_mask, model=model if multimodal else None, **multimodal)
    out = compute_logprobs(model, batch, temperature=temperature, entropy=entropy, parallel=parallel, trace=trace,
                           batch_invariant=batch_invariant)
    return LogProbOutput(
        log_probs=packed_to_grid(out.log_probs, attention_mask),
        entropy=None if out.entropy is None else packed_to_grid(out.entropy, attention_mask),
    )
