import dataclasses

from actorcore.archs.llama import SPEC as LLAMA

# Ungated MLP with the xIELU activation: down(act(up(x))).
SPEC = dataclasses.replace(LLAMA, model_type="apertus", mlp_kind="plain")
