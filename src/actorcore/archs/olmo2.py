import dataclasses

from actorcore.archs.llama import SPEC as LLAMA
from actorcore.archs.megatron_rules import McoreSpec

# Post-norm layers and q/k norms over the whole projection; nothing the packed path must special-case.
SPEC = dataclasses.replace(
    LLAMA, model_type="olmo2",
    mcore=McoreSpec(refused="OLMo 2 normalises after attention and MLP (post-norm) and its q/k norms span all "
                            "heads; Megatron-Core's GPT layer is pre-norm with per-head q/k norms"),
)
