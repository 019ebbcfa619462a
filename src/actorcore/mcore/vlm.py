"""Vision-language models (Qwen2.5-VL) on the Megatron-Core route: a Megatron ``GPTModel`` with M-RoPE for the
language model, the HF vision tower itself in front of it.

The language model is built from the HF ``text_config`` by the ordinary converter (its ``mrope_section`` becomes
Megatron's ``position_embedding_type="mrope"``) and takes the packed batch's ``[3, T]`` M-RoPE positions; Megatron
applies them to THD input per token (``cu_seqlens[-1] == T`` selects its exact per-token mapping). The vision tower
is the transformers module built from ``vision_config`` (``AutoModel.from_config``: nothing of the ViT is restated
here), held by the first pipeline stage's model as ``vision_tower`` and replicated on every tensor-parallel rank:
each rank runs it on all the batch's images, and its output replaces the word embeddings at the image and video
placeholder tokens (as HF's ``masked_scatter``), which go into the decoder as ``decoder_input``. The tower is not
tensor-parallel: it is small next to the language model (~0.7B of 7B-72B) and HF's module has no TP layout;
every TP rank gets the full gradient of the decoder input (the column-parallel layers all-reduce it), so the
replicated tower's gradients are equal on the TP ranks without any extra collective.

Refused (clear errors): sequence parallelism and context parallelism (both would split the tokens before the
image features are merged in), and a value head.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from actorcore.archs import get_spec
from actorcore.archs.megatron_rules import VISION_TOWER
from actorcore.mcore.parallel import McoreParallel


def is_vlm_config(hf_config: Any) -> bool:
    """A ``...ForConditionalGeneration`` config: a language model's ``text_config`` and a ``vision_config``."""
    return getattr(hf_config, "vision_config", None) is not None and getattr(hf_config, "text_config", None) is not None


def language_config(hf_config: Any) -> Any:
    """The VLM's ``text_config`` under the VLM's ``model_type`` (so the VLM's spec, weight rules and config
    overrides apply to the language model), with the VLM's ``tie_word_embeddings``."""
    text = copy.deepcopy(hf_config.text_config)
    text.model_type = hf_config.model_type
    tied = getattr(hf_config, "tie_word_embeddings", None)  # a hub config.json may set it only at the top
    text.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False) if tied is None else tied)
    return text


def build_vision_tower(vision_config: Any, dtype: torch.dtype, device: Any) -> torch.nn.Module:
    """The HF vision tower of ``vision_config`` (transformers' own module and math), in ``dtype``. Its random
    initial weights (before a checkpoint is loaded) come from a fixed seed, so every rank's replica is the same;
    the caller's RNG state is left as it was."""
    tower_class = vision_tower_class(vision_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tower = tower_class._from_config(copy.deepcopy(vision_config), dtype=dtype)
    return tower.to(device=device, dtype=dtype)


def vision_tower_class(vision_config: Any) -> type:
    """The transformers class that builds a tower from ``vision_config``: ``AutoModel``'s, or, where the installed
    transformers does not map the vision config there (5.17 does not for Qwen2.5-VL, 5.24 does), the pretrained
    model class of the family's modeling module whose ``config_class`` it is (what the VLM itself builds)."""
    import importlib

    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        return MODEL_MAPPING[type(vision_config)]
    except KeyError:
        pass
    module = importlib.import_module(type(vision_config).__module__.replace(".configuration_", ".modeling_"))
    found = [obj for obj in vars(module).values() if isinstance(obj, type) and issubclass(obj, PreTrainedModel)
             and obj.__dict__.get("config_class") is type(vision_config)]
    if len(found) != 1:
        raise ValueError(f"no single transformers model class builds a {type(vision_config).__name__} (found "
                         f"{[c.__name__ for c in found]}); this transformers version cannot build the vision tower")
    return found[0]


def check_vlm_build(hf_config: Any, parallel: McoreParallel, *, value_head: bool,
                    config_overrides: dict[str, Any]) -> None:
    """Refuse what the Megatron VLM route cannot build (before anything is built)."""
    if value_head:
        raise ValueError(f"{hf_config.model_type}: a value head (critic) is not supported for vision-language "
                         "models on the Megatron route; use the HF route for a VLM critic")
    if parallel.cp > 1:
        raise ValueError(f"{hf_config.model_type}: context parallelism is not supported for vision-language "
                         "models on the Megatron route (the image features are merged into the whole sequence); "
                         "use cp=1")
    if config_overrides.get("sequence_parallel"):
        raise ValueError(f"{hf_config.model_type}: sequence parallelism is not supported for vision-language "
                         "models on the Megatron route (the image features are merged into the full-sequence "
                         "embeddings); build without sequence_parallel=True")


def add_vision_tower(chunks: list[Any], hf_config: Any, dtype: torch.dtype) -> None:
    """The VLM step of ``build_gpt_model``: the first stage's chunk gets the HF ``vision_tower`` (the language
    model's chunks are built from ``language_config``)."""
    if chunks[0].config.mrope_section is None:
        raise ValueError(f"{hf_config.model_type}: the text config has no rope_parameters.mrope_section; the "
                         "Megatron VLM route needs M-RoPE positions")
    for chunk in chunks:
        if chunk.pre_process:
            device = next(chunk.parameters()).device
            chunk.add_module(VISION_TOWER, build_vision_tower(hf_config.vision_config, dtype, device))


def _features(tower: torch.nn.Module, pixels: torch.Tensor, grid_I3: torch.Tensor) -> torch.Tensor:
    """Merged tower features ``[N, D]`` of every image (or video) of the batch, in order: one tower call."""
    out = tower(pixels.to(next(tower.parameters()).dtype), grid_thw=grid_I3)
    return out.pooler_output if hasattr(out, "pooler_output") else out


def vlm_decoder_input(chunk: Any, batch: Any, config: Any) -> torch.Tensor:
    """``[T, 1, D]`` decoder input: word embeddings, with the tower's features at the placeholder tokens
    (``config``: the VLM's HF config)."""
    ids_T = batch.input_ids
    embeds = chunk.embedding(input_ids=ids_T.unsqueeze(0), position_ids=None)
    tower = getattr(chunk, VISION_TOWER)
    vision = get_spec(config.model_type).vision
    for pixels_key, grid_key, token_field in (("pixel_values", "image_grid_thw", vision.image_token_field),
                                              ("pixel_values_videos", "video_grid_thw", vision.video_token_field)):
        if token_field is None:
            continue
        mask_T = ids_T == int(getattr(config, token_field))
        pixels = batch.multimodal.get(pixels_key)
        if pixels is None:
            if bool(mask_T.any()):
                raise ValueError(f"the batch has {int(mask_T.sum())} {token_field} placeholders but no "
                                 f"{pixels_key}: pack it with actorcore.pack(..., multimodal=, model=)")
            continue
        features = _features(tower, pixels, batch.multimodal[grid_key]).to(embeds.dtype)
        if features.shape[0] != int(mask_T.sum()):
            raise ValueError(f"{int(mask_T.sum())} {token_field} placeholder tokens but the vision tower made "
                             f"{features.shape[0]} features: the batch's tokens and {grid_key} do not match")
        embeds = embeds.masked_scatter(mask_T[:, None, None].expand_as(embeds), features)
    return embeds


def vlm_chunk_forward(chunk: Any, batch: Any, params: Any, config: Any) -> torch.Tensor:
    """One chunk's forward on a packed VLM batch (positions ``[3, T]``) of the VLM ``config``; what
    ``GPTModel.forward`` returns."""
    if batch.position_ids.dim() != 2:
        raise ValueError("a VLM batch on the Megatron route needs its [3, T] M-RoPE position ids: pack it with "
                         "actorcore.pack(sequences, multimodal=..., model=hf_model)")
    decoder_input = vlm_decoder_input(chunk, batch, config) if chunk.pre_process else None
    return chunk(batch.input_ids.unsqueeze(0), batch.position_ids.unsqueeze(1), None, decoder_input=decoder_input,
                 packed_seq_params=params)
