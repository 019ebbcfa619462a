from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec, HeadTransform

# Llama layout with four multipliers. embedding_multiplier and residual_multiplier act inside the decoder, and
# attention_multiplier reaches the packed attention as its ``scaling`` (instead of 1/sqrt(head_dim));
# logits_scaling divides the logits in GraniteForCausalLM.forward, after the output layer: a head transform.
SPEC = ArchSpec(
    model_type="granite",
    head=(HeadTransform("divide", "logits_scaling"),),
    mcore=McoreSpec(refused="Granite's embedding, residual and attention multipliers and its logit scaling have "
                            "no Megatron-Core TransformerConfig fields; conversion rules are not written"),
)
