"""The plain Hugging Face references of the tests: the product's ``actorcore.hf.reference``."""

from actorcore.hf.reference import (
    logprobs_from_logits,
    padded_logits,
    padded_position_ids,
    padded_to_packed,
    reference_logprobs,
    right_padded,
)

__all__ = ["logprobs_from_logits", "padded_logits", "padded_position_ids", "padded_to_packed", "reference_logprobs",
           "right_padded"]
