"""Plain Hugging Face references the packed path is checked against (``verify``, the demo and the tests).

Two forms: the unpatched forward on a padded ``[B, S]`` batch (``reference_logprobs``, what the demo times
against), and the model's own forward one sequence at a time (``reference_logprobs_per_sequence``, what
``actorcore.verify`` uses: with batch size 1 no padding or masking question arises). Both give fp32
``log_softmax(logits / T)`` at the next token and the entropy of that distribution, aligned to the scored token.
"""

from __future__ import annotations

from typing import Any

import torch

from actorcore.archs._vision import IMAGE_KEYS, IMAGE_PATCH_KEYS, VIDEO_KEYS, VIDEO_PATCH_KEYS
from actorcore.batch import PackedBatch
from actorcore.hf.vlm.packing import IMAGE, TOKEN_TYPES_KEY, VIDEO, grid_tokens, merge_kernel, split_rows, vision_spec


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, as generation does for left-padded rows."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """An unpatched HF forward on a padded ``[B, S]`` batch; logits as the model returns them."""
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=padded_position_ids(attention_mask), use_cache=False, **kwargs)
    return out.logits


def logprobs_from_logits(logits_BSV: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / T)`` at the next token and the entropy, aligned to the scored token.

    Returns ``[B, S]`` tensors in the padded layout; 0 at each row's first real token and at padding.
    """
    logp = torch.log_softmax(logits_BSV.float() / temperature, dim=-1)
    scored = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(scored)
    scored[:, 1:] = logp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    entropy[:, 1:] = -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1)
    mask = attention_mask.bool()
    valid = mask.clone()
    valid[:, 1:] &= mask[:, :-1]  # the predicting token must be real too
    valid[:, 0] = False
    return torch.where(valid, scored, 0.0), torch.where(valid, entropy, 0.0)


def padded_to_packed(values_BS: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens of a padded ``[B, S]`` tensor, in packed order ``[T]``."""
    return values_BS[attention_mask.bool()]


def reference_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-order ``[T]`` log-probs and entropy from the unpatched padded HF forward."""
    logits = padded_logits(model, input_ids, attention_mask)
    lp, ent = logprobs_from_logits(logits, input_ids, attention_mask, temperature)
    return padded_to_packed(lp, attention_mask), padded_to_packed(ent, attention_mask)


def right_padded(sequences: list[torch.Tensor], pad_id: int = 0, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S], attention_mask [B, S])`` padded on the right (or the left)."""
    longest = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        n = int(s.numel())
        sl = slice(longest - n, longest) if left else slice(0, n)
        ids[i, sl] = s
        mask[i, sl] = 1
    return ids, mask


def split_multimodal(model: Any, batch: PackedBatch) -> list[dict[str, torch.Tensor]]:
    """Each real sequence's own processor inputs, cut from the batch's concatenated ``multimodal`` inputs.

    Text batches give empty dicts. ``mm_token_type_ids`` comes back ``[1, L]`` (for models whose forward takes
    it), pixel rows and grids as the processor gives them for a batch of one.
    """
    n, bounds, mm = batch.num_sequences, batch.cu_seqlens.tolist(), batch.multimodal
    if not mm:
        return [{} for _ in range(n)]
    vision = vision_spec(model)
    types_T = mm[TOKEN_TYPES_KEY]
    per_seq: list[dict[str, torch.Tensor]] = [
        {TOKEN_TYPES_KEY: types_T[bounds[i]: bounds[i + 1]][None]} if vision.token_types_input else {}
        for i in range(n)]
    kernel = merge_kernel(model.config, vision)
    for name, kind, (patch_key,), (grid_key, *extra_keys) in (("image", IMAGE, IMAGE_PATCH_KEYS, IMAGE_KEYS),
                                                               ("video", VIDEO, VIDEO_PATCH_KEYS, VIDEO_KEYS)):
        grid_I3 = mm.get(grid_key)
        if grid_I3 is None:
            continue
        counts = [int((types_T[bounds[i]: bounds[i + 1]] == kind).sum()) for i in range(n)]
        patch_ends = torch.cat([grid_I3.new_zeros(1), grid_I3.prod(-1).cumsum(0)]).tolist()
        for i, rows in enumerate(split_rows(grid_tokens(grid_I3, kernel, vision).tolist(), counts, name)):
            if rows.start == rows.stop:
                continue
            per_seq[i][patch_key] = mm[patch_key][patch_ends[rows.start]: patch_ends[rows.stop]]
            per_seq[i][grid_key] = grid_I3[rows]
            for key in extra_keys:
                if mm.get(key) is not None:
                    per_seq[i][key] = torch.as_tensor(mm[key])[rows]
    return per_seq


def reference_logprobs_per_sequence(model: Any, batch: PackedBatch, temperature: float = 1.0
                                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per real sequence, ``[L]`` fp32 log-probs and entropies from the model's own forward, one sequence at a
    time (no attention mask, positions and VLM features computed by the model itself); 0 at each first token."""
    device = model.get_input_embeddings().weight.device
    bounds = batch.cu_seqlens.tolist()
    log_probs, entropies = [], []
    with torch.no_grad():
        for i, inputs in enumerate(split_multimodal(model, batch)):
            ids_1L = batch.input_ids[bounds[i]: bounds[i + 1]][None].to(device)
            inputs = {k: v.to(device) for k, v in inputs.items()}
            logits = model(input_ids=ids_1L, use_cache=False, **inputs).logits
            lp, ent = logprobs_from_logits(logits, ids_1L, torch.ones_like(ids_1L), temperature)
            log_probs.append(lp[0])
            entropies.append(ent[0])
    return log_probs, entropies
