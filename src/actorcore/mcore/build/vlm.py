"""Vision-language models on the Megatron-Core route (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Kimi-K2.5): a Megatron
``GPTModel`` for the language model, the HF vision tower itself in front of it.

Kimi-K2.5: plain 1-D positions (the packed batch's ``[T]``, as for a text model), and the tower is MoonViT with
the ``mm_projector`` as one module running the HF base model's own features method, its attention held fused as
the checkpoints store it (``mcore/build/projected_tower.py``).

The language model is built from the HF ``text_config`` by the ordinary converter (its ``mrope_section`` becomes
Megatron's ``position_embedding_type="mrope"``; Qwen3-VL's interleaved layout is ``mcore/build/rotary.py``'s module) and
takes the packed batch's ``[3, T]`` M-RoPE positions; Megatron applies them to THD input per token
(``cu_seqlens[-1] == T`` selects its exact per-token mapping). The vision tower is the transformers module built
from ``vision_config`` (``AutoModel.from_config``: nothing of the ViT is restated here), held by the first
pipeline stage's model as ``vision_tower`` and replicated on every tensor-parallel rank: each rank runs it on all
the batch's images (one call) and all its videos (one call), and its output replaces the word embeddings at the
image and video placeholder tokens (as HF's ``masked_scatter``), which go into the decoder as ``decoder_input``
(each call: ``mcore/run/vlm_inputs.py``).

Deepstack (Qwen3-VL): the tower also returns one feature map per ``vision_config.deepstack_visual_indexes``
entry; decoder layer ``i`` adds map ``i`` to its output at the visual tokens (transformers'
``Qwen3VLTextModel._deepstack_process``). The additions travel with the micro-batch's ``BatchParams``
(``deepstack``) to the first stage's layers ``0 .. n-1``, whose forward adds them (per instance); a pipeline layout
that puts one of those layers on a later stage is refused.

The tower is not tensor-parallel: it is small next to the language model (~0.7B of 7B-72B) and HF's module has no
TP layout. Every TP rank gets the full gradient of the decoder input and of the deepstack additions (without
sequence parallelism the column-parallel layers all-reduce it; with it, the scatter to this rank's tokens
all-gathers it in the backward), so the replicated tower's gradients are equal on the TP ranks without any extra
collective.

Refused (clear errors): context parallelism (it would split the tokens before the image features are merged in)
and a value head.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

from actorcore.archs import get_spec
from actorcore.archs.megatron_rules import VISION_TOWER
from actorcore.mcore.parallel import McoreParallel
from actorcore.mcore.build.projected_tower import build_projected_tower, fuse_attention_qkv


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


def build_vision_tower(hf_config: Any, dtype: torch.dtype, device: Any) -> torch.nn.Module:
    """The HF vision tower of the VLM config's ``vision_config`` (transformers' own module and math), in ``dtype``;
    with a projector (Kimi-K2.5) the tower and projector as one module (``mcore/build/projected_tower.py``). Its random
    initial weights (before a checkpoint is loaded) come from a fixed seed, so every rank's replica is the same;
    the caller's RNG state is left as it was."""
    vision = get_spec(hf_config.model_type).vision
    tower_class = vision_tower_class(hf_config.vision_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tower = tower_class._from_config(copy.deepcopy(hf_config.vision_config), dtype=dtype)
        if vision.tower_fused_qkv is not None:
            fuse_attention_qkv(tower, vision.tower_fused_qkv, hf_config.vision_config)
        if vision.projector is not None:
            tower = build_projected_tower(hf_config, dtype, tower)
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


def check_vlm_build(hf_config: Any, parallel: McoreParallel, *, value_head: bool) -> None:
    """Refuse what the Megatron VLM route cannot build (before anything is built)."""
    if value_head:
        raise ValueError(f"{hf_config.model_type}: a value head (critic) is not supported for vision-language "
                         "models on the Megatron route; use the HF route for a VLM critic")
    if parallel.cp > 1:
        raise ValueError(f"{hf_config.model_type}: context parallelism is not supported for vision-language "
                         "models on the Megatron route (the image features are merged into the whole sequence); "
                         "use cp=1")


def add_vision_tower(chunks: list[Any], hf_config: Any, dtype: torch.dtype) -> None:
    """The VLM step of ``build_gpt_model``: the first stage's chunk gets the HF ``vision_tower`` (the language
    model's chunks are built from ``language_config``); with deepstack (Qwen3-VL) its first decoder layers add the
    call's deepstack features to their outputs."""
    vision = get_spec(hf_config.model_type).vision
    if vision.rope_index is not None and chunks[0].config.mrope_section is None:
        raise ValueError(f"{hf_config.model_type}: the text config has no rope_parameters.mrope_section; the "
                         "Megatron VLM route needs M-RoPE positions")
    for chunk in chunks:
        if chunk.pre_process:
            device = next(chunk.parameters()).device
            chunk.add_module(VISION_TOWER, build_vision_tower(hf_config, dtype, device))
            if vision.deepstack:
                add_deepstack(chunk, len(hf_config.vision_config.deepstack_visual_indexes), hf_config.model_type)


def add_deepstack(chunk: Any, count: int, model_type: str) -> None:
    """Decoder layers ``0 .. count - 1`` (all on this first-stage chunk) add ``packed_seq_params.deepstack[i]`` to
    their output (per instance; the addition comes with the call's ``BatchParams``, so Megatron's activation
    recomputation repeats it)."""
    layers = chunk.decoder.layers
    numbers = [layer.layer_number for layer in layers]
    if numbers[:count] != list(range(1, count + 1)):
        raise ValueError(f"{model_type}: the deepstack features go into decoder layers 0..{count - 1}, which must "
                         f"all be on the first pipeline stage (it holds layers {[n - 1 for n in numbers]}): use "
                         "fewer pipeline stages (or a layout whose first stage holds them)")
    for layer in layers[:count]:
        layer.forward = types.MethodType(_forward_adding_deepstack, layer)


def _forward_adding_deepstack(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's forward, then (a call with visual inputs) its deepstack addition at the visual tokens."""
    hidden_states, context = type(self).forward(self, *args, **kwargs)
    deltas = getattr(kwargs.get("packed_seq_params"), "deepstack", None)
    if deltas is not None:
        hidden_states = hidden_states + deltas[self.layer_number - 1]
    return hidden_states, context
