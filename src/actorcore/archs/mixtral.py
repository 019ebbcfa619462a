import dataclasses

from actorcore.archs.mistral import SPEC as MISTRAL
from actorcore.mcore.rules import moe_rules

# Experts live under block_sparse_moe on disk: w1 = gate, w3 = up, w2 = down.
SPEC = dataclasses.replace(
    MISTRAL, model_type="mixtral", mlp_kind="moe",
    mcore=dataclasses.replace(
        MISTRAL.mcore,
        rules=MISTRAL.mcore.rules + moe_rules("block_sparse_moe.", gate="w1", up="w3", down="w2"),
    ),
)
