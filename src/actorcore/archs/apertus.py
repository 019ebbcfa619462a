import dataclasses

from actorcore.archs.llama import SPEC as LLAMA
from actorcore.archs.megatron_rules import McoreSpec

# Ungated MLP with the xIELU activation: down(act(up(x))).
SPEC = dataclasses.replace(
    LLAMA, model_type="apertus", mlp_kind="plain",
    mcore=McoreSpec(refused="the xIELU activation (with learned parameters) has no Megatron-Core counterpart"),
)
