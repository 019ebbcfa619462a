import dataclasses

from actorcore.archs.llama import SPEC as LLAMA

# GeGLU MLP; attention logit softcapping and sliding windows are applied by the packed attention;
# the final logit softcap is applied exactly by the log-prob head.
SPEC = dataclasses.replace(LLAMA, model_type="gemma2", final_logit_softcap_field="final_logit_softcapping")
