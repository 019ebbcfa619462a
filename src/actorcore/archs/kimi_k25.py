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
# Not yet on Megatron: its text model (DeepSeek-V3) is, but the VLM route (mcore/vlm.py) builds one HF tower
# module from vision_config, maps its weights by name and needs M-RoPE ([3, T] positions, mrope_section), while
# Kimi-K2.5's features come from MoonViT plus an mm_projector built from the whole config, with 1-D positions.
# The checkpoint layout is the harder part: the release stores each tower block's attention fused
# (``vision_tower.encoder.blocks.{i}.wqkv.{weight,bias}``), which transformers splits on load into q/k/v with a
# RoPE row permutation of q and k (its conversion mapping: Chunk + PermuteForRope over vision_config's heads), and
# transformers 5.24's save_pretrained reverses that mapping: it writes the fused ``wqkv`` again (q and k rows
# inverse-permuted, v as is), ``norm0/norm1``, ``mlp.fc0/fc1``, ``wo``, ``mm_projector.proj.{0,2}``, the
# projector's norm as ``model.mm_projector.pre_norm.*`` and the language model as
# ``language_model.model.blocks.{i}.*`` (per-expert ``mlp.experts.{e}.*``). So a checkpoint transformers writes
# has ``wqkv`` too: neither format can be told apart by it, and every route needs one HF tensor split into three
# tower parameters with a permutation (and joined back on export), which the weight rules (one Megatron parameter
# from one or more HF tensors) cannot express.
KIMI_MEGATRON_REFUSAL = ("Kimi-K2.5 has no Megatron-Core route in actorcore yet: the route builds one HF vision tower "
                         "from vision_config with M-RoPE positions, while Kimi-K2.5's is MoonViT plus an "
                         "mm_projector built from the whole config with 1-D positions, and its checkpoints (the "
                         "release and transformers' save_pretrained alike) store the tower's attention fused "
                         "(vision_tower.encoder.blocks.*.wqkv), which transformers splits into q/k/v with a RoPE "
                         "row permutation of q and k on load; no weight rule splits one tensor into several "
                         "parameters yet. Use the HF route (its DeepSeek-V3 text model alone runs on Megatron as "
                         "deepseek_v3)")

SPEC = ArchSpec(
    model_type="kimi_k25",
    decoder="model.language_model",
    mlp_kind="moe",
    vision=VisionSpec(tower="vision_tower", rope_index=None, merge_field="merge_kernel_size", frames_pooled=True,
                      patch_row="image", token_types_input=False),
    mcore=McoreSpec(refused=KIMI_MEGATRON_REFUSAL),
    notes="packed 1-D-position VLM batches via actorcore.pack(..., multimodal=, model=)",
)
