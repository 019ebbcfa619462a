import dataclasses

from actorcore.archs.gemma2 import SPEC as GEMMA2

from actorcore.archs.megatron_rules import McoreSpec

SPEC = dataclasses.replace(GEMMA2, model_type="gemma3_text", mcore=McoreSpec(refused=GEMMA2.mcore.refused))
