"""The one table of numerical tolerances used by tests (absolute, per token / per element).

Keys say what is compared. Change a number here, not in a test. Entries that are also a promise of the
product (what ``actorcore.verify`` accepts) come from its table, so each number lives once.
"""

import torch

from actorcore.hf.verify import VERIFY_TOLERANCE

TOL: dict[str, float] = {
    # Packed path vs unpatched HF padded forward, fp32 model.
    "packed_vs_hf_fp32": VERIFY_TOLERANCE[torch.float32],
    # Parameter gradients, packed vs padded, fp32 (relative to the gradient's max magnitude): up to 1.4e-5 measured
    # on a CPU with AMX (the GRPO twin loop's fourth step; a hybrid's dt_bias 1.1e-5), under 1e-5 on the others.
    "grad_packed_vs_hf_fp32_rel": 2e-5,
    # bf16 model: fused head vs fp32-logit reference from the same bf16 hidden states.
    "fused_head_bf16_vs_fp32_logits": 1e-4,
    # Chunked kernel vs reference, fp32 inputs; gradients relative to their max magnitude.
    "kernel_chunked_vs_reference_fp32": 1e-5,
    "kernel_chunked_grad_vs_reference_fp32_rel": 1e-5,
    # bf16 fused head at the size (N=131072, H=4096, V=151936) vs the fp32 reference, on 2048 rows.
    "fused_head_bf16_vs_fp32_logits_131072_tokens": 1e-3,
    # Summed loss of the loss-fused head vs the fp32 reference's, relative (a sum over many tokens).
    "fused_loss_sum_vs_reference_rel": 1e-5,
    # Triton kernel gradients, 16-bit inputs, vs the fp32 reference, relative to the max magnitude
    # (grad_logits are rounded to 16 bits for the gradient matmuls, as in Liger).
    "kernel_triton_grad_vs_reference_bf16_rel": 2e-2,
    # Sequence parallel vs one process, fp32.
    "sp_vs_single_fp32": 1e-5,
    "grad_sp_vs_single_fp32_rel": 1e-5,
    # Grouped GEMM of bf16 rows and weights vs float64 per-expert matmuls, relative to the output's max magnitude (the
    # output's bf16 rounding).
    "grouped_gemm_bf16_vs_fp64_rel": 1e-2,
    # The Megatron route's grouped experts vs megatron-core's sequential experts with the same weights, fp32 on the
    # CPU: expert parameter gradients relative to their max magnitude (a bias's rows summed by a one-hot GEMM).
    "grouped_experts_vs_sequential_fp32_rel": 1e-5,
    # Either route's quack experts (quack's GEMMs as the CPU stand-in: SwiGLU and the probabilities from fp32
    # accumulators) vs its grouped_mm experts, both bf16 on the CPU: log-probs absolute, parameter gradients as a
    # relative L2 norm (bf16 rounding of the experts' intermediates).
    "quack_experts_vs_grouped_bf16": 1e-2,
    "grad_quack_experts_vs_grouped_bf16_rel_norm": 5e-2,
    # Megatron route vs the model's own transformers forward (padded, fp32).
    "mcore_vs_hf_fp32": 1e-4,
    # Megatron route's parameter gradients vs the transformers forward's, fp32 (relative to the max magnitude).
    "grad_mcore_vs_hf_fp32_rel": 1e-4,
    # The same on CUDA (fp32, TF32 off; NCCL sums in another order than gloo), relative to the max magnitude.
    "grad_mcore_cuda_vs_hf_fp32_rel": 2e-4,
    # The Megatron route's loss-fused head (mcore compute_loss) vs the transformers forward, fp32: a pack's summed
    # token losses, relative to the sum of their magnitudes (measured 1e-7).
    "mcore_loss_sum_vs_hf_fp32_rel": 1e-5,
    # The same head vs compute_logprobs(loss_fn=...) with the summed token losses on the same Megatron model, fp32:
    # log-probs / entropies absolute, parameter gradients relative to the max magnitude (the heads differ in
    # summation order only: measured 0 and 1.3e-6 on the CPU's chunked engine).
    "mcore_fused_loss_vs_logprobs_fp32": 1e-6,
    "grad_mcore_fused_loss_vs_logprobs_fp32_rel": 1e-5,
    # Megatron route on CUDA + NCCL (TF32 off) vs the transformers forward on the CPU, fp32.
    "mcore_cuda_vs_hf_fp32": 2e-4,
    # Context-parallel attention of a rank's query chunks vs a plain float64 softmax, fp32 inputs.
    "cp_attention_vs_reference_fp32": 1e-5,
    # Megatron route, CP ring (cp_comm_type="p2p") vs the all-gather on the same weights, fp32: log-probs / entropy,
    # and parameter gradients relative to the max magnitude (softmaxes merged block by block: only rounding differs).
    "cp_ring_vs_all_gather_fp32": 1e-5,
    "grad_cp_ring_vs_all_gather_fp32_rel": 1e-5,
    # CUDA flash kernels on bf16 inputs (context-parallel layouts) vs the plain fp32 path on the same inputs:
    # outputs absolute (bf16 rounding of O(1) values), gradients as a relative L2 norm.
    "cp_flash_bf16_vs_fp32": 2e-2,
    "grad_cp_flash_bf16_vs_fp32_rel_norm": 2e-2,
    # The same kernels' gradients per element (FA4 on ragged packs up to one 128K-token sequence), relative to the
    # gradient's max magnitude: a cap; the test's claim is "no further from fp32 than twice FlashAttention-2's error".
    "grad_flash_bf16_vs_fp32_rel_max": 3e-2,
    # The HF route on FA4 (bf16, tiny models at head dim 64, packs up to 300 tokens) vs the fp32 forward: a cap that
    # catches a broken kernel (O(1) errors); the test's claim is "no further than FlashAttention-2 (or the per-sequence
    # path for sinks) on the same model, twice over". Measured on the H100: gpt-oss with sinks ~N(0, 2) 0.119 for
    # both backends' log-probs.
    "fa4_hf_route_bf16_vs_fp32_cap": 0.25,
    # Megatron route with a bf16 model on CUDA vs transformers' fp32 forward of the same weights (2 layers): the
    # bf16 decoder's rounding.
    "mcore_bf16_cuda_vs_hf_fp32": 5e-2,
    # The same on the CPU (gloo): a bf16 glm4_moe at TP=2 x EP=2 (2 layers) vs transformers' fp32 forward; measured
    # 3.2e-3 (log-probs) and 4.5e-5 (entropy).
    "mcore_bf16_vs_hf_fp32": 1e-2,
    # A real vLLM engine (its CPU build, float32) vs actorcore on the same weights, per sampled token; measured
    # 9.5e-7 on every family that agrees (the bar is 1e-5).
    "engine_vs_actorcore_fp32": 1e-5,
    # The engine vs the Megatron route's own log-probs at TP=2 / EP=2 (float32): the route's numerics, not the update's
    # (measured 4.8e-5 max, 1.0e-5 mean at TP=2; the streamed weights themselves give 1e-6 through the HF route).
    "engine_vs_mcore_fp32": 1e-4,
    # The same engine after a bridge update vs a fresh engine started from the trainer's saved weights (the families
    # whose vLLM implementation differs from transformers'): the same kernels on the same weights.
    "engine_updated_vs_fresh_fp32": 1e-6,
    # VLM packed vs HF padded, fp32.
    "vlm_packed_vs_hf_fp32": VERIFY_TOLERANCE[torch.float32],
    # A pair of patch_model options on a bf16 CUDA model (tiny, 2 layers) vs the same weights' own forward in fp32,
    # per token: the bf16 decoder's rounding, the bound verify accepts.
    "options_bf16_cuda_vs_fp32": VERIFY_TOLERANCE[torch.bfloat16],
    # bf16 model vs the same weights in fp32: parameter gradients, relative L2 norm (bf16 decoder rounding).
    "grad_bf16_vs_fp32_rel_norm": 5e-2,
    # ... or, for a parameter whose gradient in the unpatched bf16 model is already further than that from fp32 (a
    # tiny MoE's router, where bf16 flips a token's top-k expert: 0.19 on the tiny qwen2_moe's second router, as far as
    # the patched model's 0.195), this factor times the unpatched bf16 model's distance.
    "grad_bf16_vs_own_bf16_factor": 1.5,
    # Tiled MLP vs untiled, fp64: parameter gradients summed per shard, relative to the max magnitude.
    "tiled_mlp_grad_fp64_rel": 1e-13,
    "tiled_mlp_fsdp_grad_fp64_rel": 1e-12,
    # Tiled MLP vs untiled in bf16 (shard sums of parameter gradients in fp32, rounded once to bf16).
    "tiled_mlp_grad_bf16_rel": 2e-2,
    "tiled_mlp_logprob_bf16": 1e-3,
    # Batch-invariant mode vs the plain route, bf16 on CUDA (3 layers): the same computation with other GEMM kernels
    # and their bf16 roundings; a misplaced tile or padding row would move log-probs by O(1). Not yet measured.
    "batch_invariant_vs_plain_bf16": 5e-2,
    # Compiled decoder (each layer's forward compiled by Inductor) vs the eager packed path, bf16 on CUDA (2-layer tiny
    # models): the same math with other reduction orders and fewer intermediate bf16 roundings. Log-probs and
    # entropies absolute; parameter gradients as a relative L2 norm.
    "compiled_decoder_vs_eager_bf16": 5e-2,
    "grad_compiled_decoder_vs_eager_bf16_rel_norm": 5e-2,
    # The compiled Megatron layers' RoPE vs Megatron's eager RoPE, per element of q, k and their gradients (values of
    # magnitude below 8): fp32 one multiply-add's order; bf16 one ulp there (Inductor keeps fp32 between the ops and
    # rounds once, eager rounds each product and the sum: bf16's ulp in [4, 8) is 2^-5).
    "fused_rope_vs_megatron": {torch.float32: 1e-5, torch.bfloat16: 2 ** -5},
    # The compiled decoder's mechanics on the CPU (Inductor's C++ kernels), fp32: reduction order only.
    "compiled_decoder_vs_eager_fp32": 1e-5,
    "grad_compiled_decoder_vs_eager_fp32_rel": 1e-5,
    # MoE experts path (hf.features.moe_experts) on CUDA in bf16: one experts module's output and gradients vs fp32
    # math from the same bf16 values, relative to the max magnitude (bf16 rounding of the GEMMs' outputs and of the
    # gate); the whole 2-layer tiny model (eager or compiled decoder) vs the eager decoder with its eager bf16 experts:
    # log-probs / entropies absolute, parameter gradients as a relative L2 norm (the bf16 decoder floor, as for the
    # compiled decoder; the compiled decoder's gradients are compared by their distance to fp32, the key below).
    "moe_experts_module_vs_fp32_bf16_rel": 2e-2,
    # quack's gated MLP (hf.features.swiglu_mlp) and experts (kernels.quack.moe): the arithmetic around quack's GEMMs
    # on the CPU in fp32 (a stand-in for them) vs the model's own MLP / experts, relative to the max magnitude (fp32
    # reassociation); on CUDA in bf16, one MLP's output and gradients vs fp32 math from the same bf16 values,
    # relative to the max magnitude (bf16 rounding).
    "gated_mlp_arithmetic_fp32": 1e-5,
    # The same under FSDP2 in float64 (gloo, 2 ranks, the stand-in): log-probs absolute, accumulated gradients
    # relative to the max magnitude, against one process running the model's own forward (reassociation only).
    "gated_mlp_fsdp_fp64": 1e-10,
    # The quack statistics epilogue's per-tile partials (fp32, log2 units) merged into lse / log-prob / entropy vs
    # fp64 log_softmax of the same accumulators: fp32 rounding of sums over 640 columns.
    "logprob_fp32_stats_vs_fp64": 2e-5,
    "gated_mlp_quack_vs_fp32_bf16_rel": 2e-2,
    "moe_experts_vs_eager_bf16": 5e-2,
    "grad_moe_experts_vs_eager_bf16_rel_norm": 5e-2,
    # The MoE experts path under the compiled decoder (GPU, bf16): its distance to the fp32 model (log-prob; gradient
    # norm fraction) at most this factor times transformers' grouped_mm experts' distance under the same decoder,
    # plus the floor. Measured on the H200: 0.0848 against 0.0838, 0.0123 against 0.0113 at the worst parameter.
    "moe_path_vs_fp32_over_transformers_factor": 1.5,
    "moe_path_vs_fp32_over_transformers_floor": 1e-2,
    # The token moves (permute / combine / expert bias) vs plain torch indexing, fp64: summation order only.
    "moe_moves_fp64_vs_plain": 1e-12,
    # Head inside a caller's torch.autocast region (fp32 inputs or captured hidden states) vs fp64 from the same
    # inputs: the head must still compute in fp32. Outputs absolute; gradients relative to their max magnitude.
    "head_in_autocast_vs_fp64": 1e-5,
    "head_grad_in_autocast_vs_fp64_rel": 1e-5,
    # Linear-attention kernels (packed conv1d, gated delta rule) vs plain per-sequence references, fp32; gradients
    # relative to their max magnitude.
    "linear_kernel_vs_reference_fp32": 1e-5,
    "linear_kernel_grad_vs_reference_fp32_rel": 1e-5,
    # Hybrid models (packed) vs their own forward run one sequence at a time, fp32: log-probs and entropies.
    "hybrid_vs_own_forward_fp32": VERIFY_TOLERANCE[torch.float32],
    # Hybrid MoE models' parameter gradients, packed vs the model's own forward, relative to the max magnitude. The
    # decay parameters' (A_log, dt_bias) gradients are sums over every token of the recurrence that largely cancel,
    # and the MoE experts batch tokens differently in the two runs: up to 5.6e-5 measured on A_log / dt_bias (2.5e-6
    # for the same model with dense MLPs; every other parameter below 1.1e-6).
    "grad_hybrid_moe_vs_hf_fp32_rel": 1e-4,
    # CUDA: flash-linear-attention's kernels vs the torch reference (fp32 inputs: its Triton matmuls may use TF32;
    # bf16 inputs: relative to the max magnitude), and a hybrid model on the fla path vs the same model on the CPU.
    "linear_kernel_fla_vs_torch_fp32": 1e-2,
    "linear_kernel_fla_vs_torch_bf16_rel": 2e-2,
    "hybrid_fla_vs_cpu_fp32": 1e-2,
    # A changed input must move the log-probs of its own sequence by more than this (isolation tests).
    "logprob_changed_at_least": 1e-3,
    # A transform the test switches on (softcap, halved logits) must move log-probs by more than this.
    "logprob_changed_by_transform": 1e-2,
    # Attention outputs: fp64 packed vs plain torch per sequence; a switched-on feature (sinks) must move them.
    "attention_fp64_vs_plain": 1e-12,
    "attention_changed_at_least": 1e-3,
    # fp64 analytic gradients vs central finite differences, and torch.autograd.gradcheck's eps/atol.
    "finite_difference_fp64": 1e-7,
    "gradcheck_fp64": 1e-6,
    # Kimi-K2.5's tiny model with its attention scale set to 1/sqrt(qk head dim) (yarn mscale dropped) must move
    # some log-prob by more than this: ten times what verify accepts, so a dropped mscale cannot pass verify
    # (random tiny weights attend weakly, so the move is small: 5e-4 measured).
    "logprob_changed_by_attention_scale_at_least": 10 * VERIFY_TOLERANCE[torch.float32],
    # Blockwise FP8 (e4m3) round trip: round-to-nearest with 3 mantissa bits is off by at most half a spacing,
    # 2^-4 of |w| for normal numbers and 2^-10 of the block's scale_inv for subnormals; fp32 division and
    # multiplication add a relative slack.
    "fp8_e4m3_round_rel": 2.0**-4,
    "fp8_e4m3_subnormal_abs_per_scale": 2.0**-10,
    "fp8_fp32_arith_slack_rel": 1e-6,
}
