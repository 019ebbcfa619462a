"""Per-token log-probs and entropy of a linear lm-head without [tokens, vocab] logits.

``linear_logprob_entropy`` dispatches to the plain reference, the chunked torch backend or the Triton
backend (CUDA); ``linear_logprob_entropy_vocab_parallel`` is the tensor-parallel variant whose weight is
sharded over the vocabulary; ``linear_logprob_loss`` sums a token-wise loss of the two and, on the Triton
path, forms its gradient during the forward. Importing this package imports torch only.
"""

from actorcore.kernels.logprob.api import BACKENDS, linear_logprob_entropy
from actorcore.kernels.logprob.fused_loss import LossOutput, linear_logprob_loss
from actorcore.kernels.logprob.reference import linear_logprob_entropy_reference
from actorcore.kernels.logprob.vocab_parallel import linear_logprob_entropy_vocab_parallel

__all__ = [
    "BACKENDS",
    "LossOutput",
    "linear_logprob_entropy",
    "linear_logprob_loss",
    "linear_logprob_entropy_reference",
    "linear_logprob_entropy_vocab_parallel",
]
