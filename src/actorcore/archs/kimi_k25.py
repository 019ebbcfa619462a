from actorcore.archs._vision import VisionSpec
from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec

# Kimi_K25ForConditionalGeneration (Kimi-K2.5): model.vision_tower (MoonViT: Conv2d patches [P, 3, p, p],
# learned 2-D position table resampled per grid, sinusoidal time embedding, 2-D RoPE) + model.mm_projector +
# model.language_model, a DeepseekV3Model (MLA, yarn mscale in the attention scaling, sigmoid-routed MoE with
# shared experts, the first layers dense) that reads inputs_embeds; lm_head tied to the embeddings by default and
# no transform on the logits. get_image_features runs tower and projector: a grid [t, h, w] yields
# h*w/merge_kernel_size² features (the tower averages the t frames; a video is one grid row per chunk, each its
# own placeholder run). Every token, placeholders included, gets plain 1-D positions: no M-RoPE, no rope index,
# and the processor returns no mm_token_type_ids (image and video placeholders have their own ids).
# Not yet on Megatron: its text model (DeepSeek-V3) is, but the VLM route builds one HF tower module from
# vision_config and maps its weights by name, while Kimi-K2.5's tower is MoonViT plus an mm_projector built from the
# whole config, and the release stores the tower's attention fused (``wqkv``), which transformers unfuses into
# q/k/v with a RoPE row permutation on load (its conversion mapping), besides renaming blocks, norms, the MLP and
# the projector; those transforms have no weight rule here (and transformers 5.24's save_pretrained writes the
# language model as ``language_model.model.blocks.*``, not the release's names).
KIMI_MEGATRON_REFUSAL = ("Kimi-K2.5 has no Megatron-Core route in actorcore yet: the route builds one HF vision tower "
                         "from vision_config and maps its weights by name, while Kimi-K2.5's is MoonViT plus an "
                         "mm_projector built from the whole config, and its release stores the tower's attention "
                         "fused (wqkv), which transformers splits into q/k/v with a RoPE row permutation on load; no "
                         "weight rule does that yet. Use the HF route (its DeepSeek-V3 text model alone runs on "
                         "Megatron as deepseek_v3)")

SPEC = ArchSpec(
    model_type="kimi_k25",
    decoder="model.language_model",
    mlp_kind="moe",
    vision=VisionSpec(tower="vision_tower", rope_index=None, merge_field="merge_kernel_size", frames_pooled=True,
                      patch_row="image", token_types_input=False),
    mcore=McoreSpec(refused=KIMI_MEGATRON_REFUSAL),
    notes="packed 1-D-position VLM batches via actorcore.pack(..., multimodal=, model=)",
)
