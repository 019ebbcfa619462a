"""Building a Megatron model from an HF config: the config table (``config``), what megatron-core would assert on
(``layout_check``), the model and its handle (``model``), and the modules actorcore puts in Megatron's local layer
spec: packed core attention (``attention``), planned and compiled layers (``layer``, ``fused_ops``, ``fused_rope``,
``qk_norm``, ``normed_projection``, ``rotated_qk``, ``recompute``), Gated DeltaNet (``linear_attention``), MLA's exact gradients (``mla``), norms under
sequence parallelism (``norm``), interleaved M-RoPE (``rotary``), grouped experts (``grouped_experts``,
``gather_dispatch``, ``expert_grads``, ``ep_overlap``) and a VLM's vision tower (``vlm``, ``projected_tower``)."""
