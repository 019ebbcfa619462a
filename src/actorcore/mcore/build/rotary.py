"""Interleaved multimodal RoPE (Qwen3-VL's ``rope_parameters.mrope_interleaved``) for Megatron's ``GPTModel``.

Megatron-Core's ``MultimodalRotaryEmbedding`` gives the (t, h, w) position rows contiguous blocks of rotary
frequencies (Qwen2-VL / Qwen2.5-VL). Qwen3-VL interleaves them: frequency ``i`` rotates by the height position
when ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, by the width position when ``i % 3 == 2`` and
``i < 3 * mrope_section[2]``, and by the temporal position otherwise (transformers'
``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``). ``InterleavedMultimodalRotaryEmbedding`` takes the
place of the model's ``rotary_pos_emb`` (per instance, ``use_interleaved_mrope``) with Megatron's call signature
and output layout (``[S, B, 1, 2 * F]`` angles, the halves repeated for the non-interleaved rotate-half), so
Megatron's THD rotary application uses it unchanged.

Legend: ``S`` tokens of the packed sequence, ``B`` batch (1 for THD), ``F`` rotary frequencies (head dim / 2).
"""

from __future__ import annotations

from typing import Any

import torch


def interleaved_frequency_rows(frequencies: int, mrope_section: list[int]) -> torch.Tensor:
    """``[F]`` the position row (0: t, 1: h, 2: w) that drives each rotary frequency."""
    if len(mrope_section) != 3 or sum(mrope_section) != frequencies:
        raise ValueError(f"mrope_section {list(mrope_section)} must have 3 entries summing to the {frequencies} "
                         "rotary frequencies of a head")
    rows = torch.zeros(frequencies, dtype=torch.long)
    for row in (1, 2):
        rows[row:3 * mrope_section[row]:3] = row
    return rows


class InterleavedMultimodalRotaryEmbedding(torch.nn.Module):
    """Megatron's ``MultimodalRotaryEmbedding`` interface with Qwen3-VL's interleaved frequency layout."""

    def __init__(self, inv_freq_F: torch.Tensor) -> None:
        super().__init__()
        self.inv_freq = inv_freq_F.float()

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group: Any = None) -> torch.Tensor:
        """``position_ids`` ``[3, B, S]`` -> angles ``[S, B, 1, 2 * F]``."""
        if cp_group is not None and cp_group.size() > 1:
            raise ValueError("interleaved M-RoPE under context parallelism is not supported (VLMs run at cp=1)")
        inv_freq_F = self.inv_freq.to(position_ids.device)
        freqs_3BSF = position_ids.float()[..., None] * inv_freq_F
        rows_F = interleaved_frequency_rows(inv_freq_F.numel(), list(mrope_section)).to(position_ids.device)
        index = rows_F.view(1, 1, 1, -1).expand(1, *freqs_3BSF.shape[1:])
        freqs_BSF = freqs_3BSF.gather(0, index)[0]
        emb_BS2F = torch.cat((freqs_BSF, freqs_BSF), dim=-1)
        return emb_BS2F.transpose(0, 1)[:, :, None, :].contiguous()


def use_interleaved_mrope(chunk: Any) -> None:
    """Give ``chunk`` (a ``GPTModel`` built with ``position_embedding_type="mrope"``) the interleaved layout, with
    the inverse frequencies Megatron computed for it (same base, head dim and rotary percent)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    current = chunk.rotary_pos_emb
    if not isinstance(current, MultimodalRotaryEmbedding):
        raise ValueError(f"interleaved M-RoPE needs a model built with M-RoPE, got {type(current).__name__}")
    if current.rotary_interleaved or current.seq_len_interpolation_factor is not None:
        raise ValueError("interleaved M-RoPE with interleaved rotary pairs or linear position interpolation is not "
                         "supported on the Megatron route")
    chunk.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(current.inv_freq.detach().clone())
