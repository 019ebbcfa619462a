"""Kernel layer: model-agnostic compute, a folder per concern: the fused log-prob/entropy head (``logprob/``),
packed and ring attention (``attention/``: FlashAttention-4, flash-attn 2, torch's varlen kernel or per-sequence SDPA,
chosen in ``attention.backends``), packed linear attention (``linear_attention/``), quack's Hopper GEMMs with fused
epilogues for MoE experts and SwiGLU MLPs (``quack/``, behind its one availability probe
``quack.runtime.quack_refusal``); one-file concerns beside them: ``tiled_mlp``, ``batch_invariant``, ``precision``
(autocast-free fp32 numerics, the critic's value head), ``trace``, ``compiled_graphs`` (room for a compiled region's
graph variants, and graphs that report their runs), ``selective_checkpoint`` (the selective
checkpointing policy), ``recomputed_input`` (an op keeping a norm's input and recomputing its output), the MoE token moves ``moe_permute``, grouped GEMMs over rows sorted by expert
(``grouped_gemm``) and the MXFP4 weights of gpt-oss checkpoints (``mxfp4``).

Nothing heavy is imported here; import the submodule you need, e.g.
``from actorcore.kernels.logprob import linear_logprob_entropy``. Kernels import only torch (and triton / flash-attn /
flash-attn-4 / flash-linear-attention lazily, when such a backend is chosen) and, of actorcore, the result types
(``actorcore.outputs``); they never import model code or issue collectives.

Tracing which path ran: the public entry points (``linear_logprob_entropy``, ``linear_logprob_loss``,
``linear_logprob_entropy_vocab_shard`` and ``parallel.vocab_parallel.linear_logprob_entropy_vocab_parallel``,
``varlen_causal_attention``, ``causal_attention_at_positions``, ``causal_conv1d_packed``, ``gated_delta_rule_packed``) take ``trace: collections.Counter[str] | None``. When given, they add to it
(backward recomputation included: the autograd context keeps the same Counter) under these keys:

    logprob:reference             calls that ran the plain fp32 reference
    logprob:torch_chunk           [C, V] logit chunks built by the chunked torch engine (forward and recompute)
    logprob:torch_chunk_rows      the rows C of those chunks, summed
    logprob:triton_forward        launches of the Triton forward statistics kernel (pointer or TMA loads)
    logprob:triton_forward_tma    those of them that used TMA loads
    logprob:triton_backward       launches of the Triton grad_logits recompute kernel (one per backward block)
    logprob:triton_fused_loss     chunks run by the Triton loss-fused forward (``linear_logprob_loss``)
    varlen_attention:<backend>    calls per attention backend that ran: fa4, flash_attn, torch_varlen, segments
                                  (inside a layer the compiled decoder compiled: counted by the layer, one per call)
    varlen_attention:at_positions calls of ``causal_attention_at_positions`` (context-parallel query chunks) that
                                  ran one SDPA call per run of positions; ``...:at_positions:<backend>`` those that
                                  ran one varlen flash call (torch_varlen, flash_attn) over every run's key prefix
    varlen_attention:cp_ring      context-parallel attention calls that ran the ring exchange (Megatron route,
                                  ``cp_comm_type="p2p"``; counted by ``mcore.build.attention``, one per layer call, each
                                  running ``block_attention``'s plain per-block kernel once per CP rank);
                                  ``varlen_attention:cp_ring_flash`` those whose blocks ran ``flash_blocks``
    causal_conv1d:<backend>       packed causal conv1d calls (``linear_attention.packed.causal_conv1d_packed``): torch, fla
    gated_delta_rule:<backend>    packed gated delta rule calls (``linear_attention.packed.gated_delta_rule_packed``): torch, fla
                                  (torch: ``delta_rule_chunks.delta_rule_blocks``, its output's grad_fn says so)

Nothing else in the package keeps counters: there is no module-level state that a test reads or sets.
"""
