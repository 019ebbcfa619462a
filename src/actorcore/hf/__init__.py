"""Hugging Face route: packed attention, compute_logprobs / compute_values, patching."""
