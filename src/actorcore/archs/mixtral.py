import dataclasses

from actorcore.archs.megatron_rules import (
    ATTENTION_RULES,
    EMBEDDING_RULES,
    McoreSpec,
    grouped_expert_rules,
    moe_rules,
)
from actorcore.archs.mistral import SPEC as MISTRAL

# Every layer is sparse (no dense MLP rules). Experts live under block_sparse_moe on disk: w1 = gate, w3 = up,
# w2 = down. In transformers 5's grouped layout the router is mlp.gate and the experts
# mlp.experts.{gate_up,down}_proj.
SPEC = dataclasses.replace(
    MISTRAL, model_type="mixtral", mlp_kind="moe",
    mcore=McoreSpec(
        rules=EMBEDDING_RULES + ATTENTION_RULES + moe_rules("block_sparse_moe.", gate="w1", up="w3", down="w2"),
        grouped_expert_rules=grouped_expert_rules(router="mlp.gate"),
    ),
)
