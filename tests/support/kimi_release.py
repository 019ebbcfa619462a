"""Kimi-K2.5 checkpoints under the release's tensor names (moonshotai/Kimi-K2.5), for tests: the names the release
stores, a tiny model saved under them, and its routed experts swapped for the release's INT4 layout.

The names were read off independent loaders of the release (vLLM's ``kimi_k25.py`` / ``kimi_k25_vit.py``
``load_weights``, SGLang's ``kimi_k25.py``, Megatron-Bridge's ``kimi_k25_vl_bridge.py`` and its tests) and a listing
of the release's 208,550 tensors; ``docs/megatron.md`` has the table. They are written here on their own, not taken
from actorcore's weight rules, so a change to the rules cannot move them too.

transformers' ``save_pretrained`` (5.17 and 5.24) writes three prefixes otherwise (``SAVE_PRETRAINED_PREFIXES``);
``save_release_checkpoint`` renames them back.
"""

from __future__ import annotations

import json
import os
import re

import torch

# Every tensor name of the release, with the layer / expert / block indices as {layer} / {expert} / {block}. The
# release stores each routed expert's gate/up/down weight INT4-packed (``weight_packed`` int32 [out, in/8],
# ``weight_scale`` bf16 [out, in/32], ``weight_shape`` [2]); a dense checkpoint has ``weight`` there.
RELEASE_NAMES = frozenset({
    "language_model.lm_head.weight",
    "language_model.model.embed_tokens.weight",
    "language_model.model.norm.weight",
    *(f"language_model.model.layers.{{layer}}.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",  # the dense first layer
        "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
        "mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight",
        "mlp.experts.{expert}.down_proj.weight",
    )),
    "mm_projector.pre_norm.weight", "mm_projector.pre_norm.bias",
    "mm_projector.proj.0.weight", "mm_projector.proj.0.bias", "mm_projector.proj.2.weight", "mm_projector.proj.2.bias",
    "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.proj.bias",
    "vision_tower.patch_embed.pos_emb.weight",
    *(f"vision_tower.encoder.blocks.{{block}}.{n}.{kind}" for n in ("wqkv", "wo", "norm0", "norm1", "mlp.fc0", "mlp.fc1")
      for kind in ("weight", "bias")),
    "vision_tower.encoder.final_layernorm.weight", "vision_tower.encoder.final_layernorm.bias",
})

# (what transformers' save_pretrained writes, what the release stores)
SAVE_PRETRAINED_PREFIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("vision_tower.encoder.patch_embed.proj.", "vision_tower.patch_embed.proj."),
    ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."),
)
_INDICES = ((re.compile(r"\.layers\.\d+\."), ".layers.{layer}."), (re.compile(r"\.experts\.\d+\."), ".experts.{expert}."),
            (re.compile(r"\.blocks\.\d+\."), ".blocks.{block}."))


def name_pattern(name: str) -> str:
    """``name`` with its layer, expert and block indices replaced by the placeholders of ``RELEASE_NAMES``."""
    for index, placeholder in _INDICES:
        name = index.sub(placeholder, name)
    return name


def release_name(saved: str) -> str:
    """The release's name of a tensor that save_pretrained wrote as ``saved``."""
    for written, stored in SAVE_PRETRAINED_PREFIXES:
        if saved.startswith(written):
            return stored + saved[len(written):]
    return saved


def save_release_checkpoint(model: torch.nn.Module, directory: str) -> list[str]:
    """``model`` (a ``Kimi_K25ForConditionalGeneration``) saved by its own ``save_pretrained``, its tensors renamed
    to the release's names; returns them. Every name must be one of ``RELEASE_NAMES``."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = {release_name(name): tensor for name, tensor in load_file(path).items()}
    foreign = sorted(n for n in tensors if name_pattern(n) not in RELEASE_NAMES)
    assert not foreign, f"not a release name: {foreign}"
    save_file(tensors, path, metadata={"format": "pt"})
    return sorted(tensors)


def with_int4_experts(directory: str, config_holder: str) -> None:
    """The checkpoint in ``directory`` with its routed experts in the release's INT4 layout (compressed-tensors
    ``weight_packed`` int32 [out, in/8], ``weight_scale`` [out, in/32], ``weight_shape``; the values do not matter
    here) and the release's ``quantization_config`` in config.json (``"both"`` places, or ``"text"`` only)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = {}
    for name, tensor in load_file(path).items():
        if not re.search(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", name):
            tensors[name] = tensor
            continue
        out, inp = tensor.shape
        tensors[name + "_packed"] = torch.zeros(out, -(-inp // 8), dtype=torch.int32)
        tensors[name + "_scale"] = torch.ones(out, -(-inp // 32), dtype=torch.bfloat16)
        tensors[name + "_shape"] = torch.tensor([out, inp], dtype=torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    quantization = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
                    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["text_config"]["quantization_config"] = quantization
    if config_holder == "both":
        config["quantization_config"] = quantization
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
