import dataclasses

from actorcore.archs.mistral import SPEC as MISTRAL
from actorcore.archs.megatron_rules import grouped_expert_rules, moe_rules

# Experts live under block_sparse_moe on disk: w1 = gate, w3 = up, w2 = down. In transformers 5's grouped
# layout the router is mlp.gate and the experts mlp.experts.{gate_up,down}_proj.
SPEC = dataclasses.replace(
    MISTRAL, model_type="mixtral", mlp_kind="moe",
    mcore=dataclasses.replace(
        MISTRAL.mcore,
        rules=MISTRAL.mcore.rules + moe_rules("block_sparse_moe.", gate="w1", up="w3", down="w2"),
        grouped_expert_rules=grouped_expert_rules(router="mlp.gate"),
    ),
)
