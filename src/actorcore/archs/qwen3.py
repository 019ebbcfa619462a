import dataclasses

from actorcore.archs.llama import SPEC as LLAMA

SPEC = dataclasses.replace(LLAMA, model_type="qwen3")
