"""Running a built Megatron model on packed batches: per-token log-probs, entropy, values and the MTP loss through
Megatron's schedule (``forward``), a token-wise loss fused into the last stage's head (``loss``), the per-micro-batch
parameters (``batch_params``), each call's layer plan and its check (``call_plan``) and a VLM's decoder input
(``vlm_inputs``)."""
