import dataclasses

from actorcore.archs.llama import SPEC as LLAMA
from actorcore.archs.spec import HeadTransform
from actorcore.archs.megatron_rules import McoreSpec

# GeGLU MLP; attention logit softcapping and sliding windows are applied by the packed attention;
# the final logit softcap is applied exactly by the log-prob head.
SPEC = dataclasses.replace(
    LLAMA, model_type="gemma2", head=(HeadTransform("softcap", "final_logit_softcapping"),),
    mcore=McoreSpec(refused="Gemma 2/3 need attention-logit and final-logit softcapping, sandwich (post-attention and "
                            "post-MLP) norms, (1 + weight) RMSNorm and a scaled embedding, which Megatron-Core's "
                            "GPT layer does not have"),
)
