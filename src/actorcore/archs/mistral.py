import dataclasses

from actorcore.archs.llama import SPEC as LLAMA

# Megatron part: the llama rules; the sliding window maps to TransformerConfig.window_size.
SPEC = dataclasses.replace(LLAMA, model_type="mistral")
