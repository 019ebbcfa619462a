from actorcore.archs._vision import VisionSpec
from actorcore.archs.deepseek_v3 import SPEC as DEEPSEEK_V3
from actorcore.archs.megatron_rules import VISION_TOWER, McoreSpec, WeightRule, with_hf_prefix, without_value_head
from actorcore.archs.spec import ArchSpec

# Kimi_K25ForConditionalGeneration (Kimi-K2.5): model.vision_tower (MoonViT: Conv2d patches [P, 3, p, p],
# learned 2-D position table resampled per grid, sinusoidal time embedding, 2-D RoPE) + model.mm_projector +
# model.language_model, a DeepseekV3Model (MLA, yarn mscale in the attention scaling, sigmoid-routed MoE with
# shared experts, the first layers dense) that reads inputs_embeds; lm_head tied to the embeddings by default and
# no transform on the logits. get_image_features runs tower and projector: a grid [t, h, w] yields
# h*w/merge_kernel_size² features (the tower averages the t frames; a video is one grid row per chunk, each its
# own placeholder run). Every token, placeholders included, gets plain 1-D positions: no M-RoPE, no rope index,
# and the processor returns no mm_token_type_ids (image and video placeholders have their own ids).
# On Megatron (``mcore/build/vlm.py``, ``mcore/build/projected_tower.py``): the language model is DeepSeek-V3's (its rules and
# config overrides) with plain 1-D positions; tower and projector are one replicated module running the HF base
# model's own get_image_features.
#
# Checkpoint names: the release's (moonshotai/Kimi-K2.5, as vLLM's and SGLang's kimi_k25 loaders and
# Megatron-Bridge's Kimi-K2.5 bridge read it): the language model under ``language_model.model.layers.{i}.*`` and
# ``language_model.lm_head``; the tower under ``vision_tower.patch_embed.*`` and ``vision_tower.encoder.*``, each
# block's attention fused as ``vision_tower.encoder.blocks.{i}.wqkv`` (q and k rows interleaved per head; the
# Megatron tower holds this tensor and makes transformers' q/k/v from it), ``norm0/norm1``, ``mlp.fc0/fc1``, ``wo``;
# the projector as ``mm_projector.pre_norm`` and ``mm_projector.proj.{0,2}``. Export writes these names.
# transformers' save_pretrained writes three prefixes otherwise (its load-time renames reversed: "blocks" for
# "layers" reaches the text model, the patch embedding lands under ``encoder``, the projector's norm keeps the
# in-memory ``model.`` prefix); such a checkpoint loads too (``stored_prefixes``). The release's experts are INT4
# (compressed-tensors ``weight_packed``), refused by the reader: dequantize them first.
_TOWER, _ENCODER = f"{VISION_TOWER}.vision_tower.", "vision_tower.encoder."
_BLOCK_NAMES = (("norm1", "norm0"), ("norm2", "norm1"), ("attn.wqkv", "wqkv"), ("attn.proj", "wo"),
                ("mlp.fc1", "mlp.fc0"), ("mlp.fc2", "mlp.fc1"))
TOWER_RULES = tuple(
    WeightRule(f"{_TOWER}layers.{{layer}}.{ours}.{kind}", (f"{_ENCODER}blocks.{{layer}}.{stored}.{kind}",))
    for ours, stored in _BLOCK_NAMES for kind in ("weight", "bias")
) + tuple(WeightRule(_TOWER + name, (stored,)) for name, stored in (
    ("patch_embed.proj.weight", "vision_tower.patch_embed.proj.weight"),
    ("patch_embed.proj.bias", "vision_tower.patch_embed.proj.bias"),
    ("patch_embed.pos_emb.position_embeddings", "vision_tower.patch_embed.pos_emb.weight"),
    ("final_layernorm.weight", _ENCODER + "final_layernorm.weight"),
    ("final_layernorm.bias", _ENCODER + "final_layernorm.bias"),
)) + tuple(WeightRule(f"{VISION_TOWER}.mm_projector.pre_norm.{kind}", (f"mm_projector.pre_norm.{kind}",))
           for kind in ("weight", "bias")
) + tuple(WeightRule(f"{VISION_TOWER}.mm_projector.{ours}.{kind}", (f"mm_projector.proj.{stored}.{kind}",))
          for ours, stored in (("in_proj", 0), ("out_proj", 2)) for kind in ("weight", "bias"))

# (the release's prefix, the one transformers' save_pretrained writes instead)
SAVE_PRETRAINED_NAMES = (
    ("language_model.model.layers.", "language_model.model.blocks."),
    ("vision_tower.patch_embed.proj.", "vision_tower.encoder.patch_embed.proj."),
    ("mm_projector.pre_norm.", "model.mm_projector.pre_norm."),
)


def _language_model(rules: tuple[WeightRule, ...]) -> tuple[WeightRule, ...]:
    """DeepSeek-V3's rules under the release's names; no critic head (refused for VLMs on Megatron)."""
    rules = with_hf_prefix(without_value_head(rules), "model.", "language_model.model.")
    return with_hf_prefix(rules, "lm_head.", "language_model.lm_head.")


SPEC = ArchSpec(
    model_type="kimi_k25",
    decoder="model.language_model",
    mlp_kind="moe",
    vision=VisionSpec(tower="vision_tower", rope_index=None, merge_field="merge_kernel_size", frames_pooled=True,
                      patch_row="image", token_types_input=False, projector="mm_projector",
                      projector_class="Kimi_K25MultimodalProjection", tower_fused_qkv="wqkv"),
    mcore=McoreSpec(rules=_language_model(DEEPSEEK_V3.mcore.rules) + TOWER_RULES,
                    config_overrides=dict(DEEPSEEK_V3.mcore.config_overrides),
                    stored_prefixes=SAVE_PRETRAINED_NAMES),
    notes="packed 1-D-position VLM batches via actorcore.pack(..., multimodal=, model=)",
)
