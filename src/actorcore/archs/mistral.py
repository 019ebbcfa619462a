import dataclasses

from actorcore.archs.llama import SPEC as LLAMA
from actorcore.archs.megatron_rules import DENSE_RULES, McoreSpec

# Megatron part: the llama rules; the sliding window maps to TransformerConfig.window_size.
SPEC = dataclasses.replace(LLAMA, model_type="mistral", mcore=McoreSpec(rules=DENSE_RULES))
