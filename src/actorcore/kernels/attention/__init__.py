"""Attention kernels over packed variable-length sequences, model-agnostic (torch; flash-attn and flash-attn-4
lazily).

- ``backends``: the backends, their availability probes and refusals, and the ``"auto"`` rule.
- ``fa4``: FlashAttention-4's CuTe DSL kernels as custom ops (Hopper).
- ``varlen``: causal attention within each segment of ``cu_seqlens`` (the HF route's packed attention and
  Megatron's core attention), choosing the fastest available backend; and attention at given positions for
  context parallelism's query chunks.
- ``block_attention``: partial attention of queries against one block of keys with its log-sum-exp, and the
  merge of such blocks (context parallelism's ring exchange), plain fp32.
- ``flash_blocks``: the same per-block work with flash kernels on CUDA, for the layouts they cover.
"""
