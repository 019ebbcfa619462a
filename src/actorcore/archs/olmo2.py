import dataclasses

from actorcore.archs.llama import SPEC as LLAMA

# Post-norm layers and q/k norms over the whole projection; nothing the packed path must special-case.
SPEC = dataclasses.replace(LLAMA, model_type="olmo2")
