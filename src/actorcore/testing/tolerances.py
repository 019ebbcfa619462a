"""The one table of numerical tolerances used by tests (absolute, per token / per element).

Keys say what is compared. Change a number here, not in a test.
"""

TOL: dict[str, float] = {
    # Packed path vs unpatched HF padded forward, fp32 model.
    "packed_vs_hf_fp32": 1e-5,
    # Parameter gradients, packed vs padded, fp32 (relative to the gradient's max magnitude).
    "grad_packed_vs_hf_fp32_rel": 1e-5,
    # bf16 model: fused head vs fp32-logit reference from the same bf16 hidden states.
    "fused_head_bf16_vs_fp32_logits": 1e-4,
    # Chunked kernel vs reference, fp32 inputs; gradients relative to their max magnitude.
    "kernel_chunked_vs_reference_fp32": 1e-5,
    "kernel_chunked_grad_vs_reference_fp32_rel": 1e-5,
    # Triton kernel gradients, 16-bit inputs, vs the fp32 reference, relative to the max magnitude
    # (grad_logits are rounded to 16 bits for the gradient matmuls, as in Liger).
    "kernel_triton_grad_vs_reference_bf16_rel": 2e-2,
    # Sequence parallel vs one process, fp32.
    "sp_vs_single_fp32": 1e-5,
    "grad_sp_vs_single_fp32_rel": 1e-5,
    # Megatron route vs the model's own transformers forward (padded, fp32).
    "mcore_vs_hf_fp32": 1e-4,
    # Megatron route's parameter gradients vs the transformers forward's, fp32 (relative to the max magnitude).
    "grad_mcore_vs_hf_fp32_rel": 1e-4,
    # VLM packed vs HF padded, fp32.
    "vlm_packed_vs_hf_fp32": 1e-5,
}
