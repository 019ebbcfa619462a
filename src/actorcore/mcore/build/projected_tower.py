"""A VLM's vision tower with a projector beside it (Kimi-K2.5: MoonViT + ``mm_projector``), as the one replicated
module the Megatron route puts in front of the language model, and the tower's attention held fused as its
checkpoints store it.

``ProjectedTower`` holds transformers' own tower and projector under their HF attribute names and runs the HF base
model's own features method (``VisionSpec.image_features``) on them: nothing of the ViT or the projector is
restated here.

Fused attention: Kimi-K2.5's checkpoints (the release and transformers' ``save_pretrained`` alike) store each
block's attention as one ``wqkv`` ``[3D, D]`` whose q and k rows interleave each head's two rotary halves;
transformers splits it into ``q_proj`` / ``k_proj`` / ``v_proj`` on load and permutes the q and k rows (its
``PermuteForRope``). Here the block holds that ``wqkv`` as its parameter, and ``q_proj`` / ``k_proj`` / ``v_proj``
become views that make transformers' rows from it in every forward (with transformers' own permutation), so the
checkpoint tensor maps onto one parameter by name and the gradient reaches it through the views.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_ROTARY = ("q_proj", "k_proj")


class ProjectedTower(torch.nn.Module):
    """Tower and projector (children named as in the HF base model); ``forward(pixels, grid_thw)`` returns the
    projected features ``[N, D_text]`` of every grid row, in order (the base model's features method)."""

    def __init__(self, tower_name: str, tower: torch.nn.Module, projector_name: str, projector: torch.nn.Module,
                 features: Any) -> None:
        super().__init__()
        self.add_module(tower_name, tower)
        self.add_module(projector_name, projector)
        self._features = features  # the HF base model class's method, unbound

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        out = self._features(self, pixel_values, grid_thw)
        return torch.cat(list(out.pooler_output))


def build_projected_tower(hf_config: Any, dtype: torch.dtype, tower: torch.nn.Module) -> ProjectedTower:
    """``tower`` (built from ``vision_config``) with the projector built from the whole config, and the features
    method of the HF base model class of ``hf_config`` (``AutoModel``'s)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from actorcore.archs import get_spec

    vision = get_spec(hf_config.model_type).vision
    module = importlib.import_module(type(hf_config).__module__.replace(".configuration_", ".modeling_"))
    projector = getattr(module, vision.projector_class)(hf_config).to(dtype)
    features = getattr(MODEL_MAPPING[type(hf_config)], vision.image_features)
    return ProjectedTower(vision.tower, tower, vision.projector, projector, features)


class _FusedRows(torch.nn.Module):
    """One of q / k / v as transformers holds it, made from rows of the block's fused ``wqkv`` (no parameter of
    its own; the fused linear is held without registering it, so it is one parameter of the block)."""

    def __init__(self, fused: torch.nn.Linear, index: int, permute: Any) -> None:
        super().__init__()
        self._fused = (fused,)
        self._index = index
        self._permute = permute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused[0]
        weight = self._permute(fused.weight.chunk(3)[self._index])
        bias = None if fused.bias is None else self._permute(fused.bias.chunk(3)[self._index])
        return F.linear(x, weight, bias)


def fuse_attention_qkv(tower: torch.nn.Module, fused_name: str, vision_config: Any) -> int:
    """Every attention of ``tower`` with ``q_proj`` / ``k_proj`` / ``v_proj`` linears gets one ``fused_name``
    linear holding them in the checkpoint's layout (q and k rows interleaved per head, transformers'
    ``PermuteForRope`` inverse) and views in their place; returns how many attentions were fused."""
    from transformers.core_model_loading import PermuteForRope

    to_hf = PermuteForRope()  # checkpoint rows -> transformers' rows, per head of vision_config
    from_hf = PermuteForRope(inverse=True)
    count = 0
    for attn in list(tower.modules()):
        parts = [getattr(attn, name, None) for name in _PROJECTIONS]
        if not all(isinstance(p, torch.nn.Linear) for p in parts):
            continue
        q = parts[0]
        fused = torch.nn.Linear(q.in_features, 3 * q.out_features, bias=q.bias is not None,
                                dtype=q.weight.dtype, device=q.weight.device)
        with torch.no_grad():
            for kind in ("weight", "bias"):
                rows = [getattr(p, kind) for p in parts]
                if rows[0] is None:
                    continue
                rows = [from_hf._permute_for_rope(r, vision_config) if name in _ROTARY else r
                        for name, r in zip(_PROJECTIONS, rows)]
                getattr(fused, kind).copy_(torch.cat(rows))
        attn.add_module(fused_name, fused)
        for index, name in enumerate(_PROJECTIONS):
            permute = ((lambda t: to_hf._permute_for_rope(t, vision_config)) if name in _ROTARY
                       else (lambda t: t))
            setattr(attn, name, _FusedRows(fused, index, permute))
        count += 1
    return count
