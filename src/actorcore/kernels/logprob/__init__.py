"""Per-token log-probs and entropy of a linear lm-head without [tokens, vocab] logits.

``linear_logprob_entropy`` dispatches to the plain reference, the chunked torch backend or the Triton
backend (CUDA); ``linear_logprob_entropy_vocab_shard`` computes them from one shard of the vocabulary
rows, the caller merging the per-token statistics (``merge_partial_stats``) over its group
(``actorcore.parallel.vocab_parallel`` does, over a tensor-parallel group); ``linear_logprob_loss`` sums a
token-wise loss of the two and, on the Triton path, forms its gradient during the forward. Importing this
package imports torch only.
"""

from actorcore.kernels.logprob._common import check_options, merge_partial_stats
from actorcore.kernels.logprob.api import BACKENDS, linear_logprob_entropy
from actorcore.kernels.logprob.fused_loss import LossOutput, linear_logprob_loss
from actorcore.kernels.logprob.reference import linear_logprob_entropy_reference
from actorcore.kernels.logprob.vocab_shard import linear_logprob_entropy_vocab_shard

__all__ = [
    "BACKENDS",
    "check_options",
    "LossOutput",
    "linear_logprob_entropy",
    "linear_logprob_loss",
    "linear_logprob_entropy_reference",
    "linear_logprob_entropy_vocab_shard",
    "merge_partial_stats",
]
