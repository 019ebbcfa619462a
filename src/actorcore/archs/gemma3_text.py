import dataclasses

from actorcore.archs.gemma2 import SPEC as GEMMA2

SPEC = dataclasses.replace(GEMMA2, model_type="gemma3_text")
