import dataclasses

from actorcore.archs.qwen3 import SPEC as QWEN3

# Sparse layers use Qwen3MoeSparseMoeBlock; layers listed in config.mlp_only_layers stay dense.
SPEC = dataclasses.replace(QWEN3, model_type="qwen3_moe", mlp_kind="moe")
