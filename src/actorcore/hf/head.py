"""The output head: what ``...ForCausalLM.forward`` does after the decoder, applied from spec data, fused.

Legend: ``T`` tokens, ``D`` hidden, ``V`` vocabulary.

The fused kernels compute ``cap(h W^T) / temperature`` without ``[T, V]`` logits (``cap``: an optional
final-logit softcap). Every transform an arch spec declares (``ArchSpec.head``: softcap, multiply, divide,
in the order the model's forward applies them) is folded into those two numbers: a factor ``m`` applied after
the softcap, or with none, is the temperature ``T / m``. This is the only module that reads them; ``verify``
checks the result against the model's own forward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from actorcore.archs import ArchSpec, UnsupportedArchitectureError, text_config
from actorcore.hf.as_forward import call_as_forward
from actorcore.kernels.logprob import LossOutput, check_options, linear_logprob_entropy, linear_logprob_loss


@dataclass(frozen=True)
class HeadParams:
    """The spec's head transforms for one model: logits = ``scale * cap(h W^T)``."""

    softcap: float | None = None
    scale: float = 1.0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The same transforms on materialised logits (for callers that want ``[T, V]`` logits)."""
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits * self.scale if self.scale != 1.0 else logits


def head_params(model: Any, spec: ArchSpec) -> HeadParams:
    config = text_config(model.config)
    softcap, scale = None, 1.0
    for transform in spec.head:
        value = getattr(config, transform.field, None)
        if transform.is_neutral(value):
            continue
        value = float(value)
        if transform.op == "softcap":
            if scale != 1.0:
                raise UnsupportedArchitectureError(
                    f"{spec.model_type}: the logits are scaled before the final softcap, which the fused head "
                    "cannot apply (it caps the raw logits)")
            softcap = value
        elif transform.op == "multiply":
            scale *= value
        else:
            if value == 0:
                raise ValueError(f"{spec.model_type}: config.{transform.field} is 0; the logits would be divided by 0")
            scale /= value
    return HeadParams(softcap=softcap, scale=scale)


def output_layer(model: Any) -> torch.nn.Module:
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm head); compute_logprobs needs a "
                         "...ForCausalLM model")
    if hasattr(head, "base_layer") or hasattr(head, "lora_A"):
        raise ValueError("the lm head carries a PEFT adapter, which actorcore's fused head (it reads the output "
                         "weight directly) would ignore: leave lm_head out of the LoRA target_modules")
    if getattr(head, "bias", None) is not None:
        raise ValueError("the lm head has a bias, which actorcore's fused log-prob head does not support")
    return head


def check_head_options(temperature: float, entropy: bool, trace: Counter | None = None,
                       batch_invariant: bool = False) -> float:
    """The kernels' own option checks, run before the decoder so a bad option costs no forward pass."""
    check_options(temperature=temperature, entropy=entropy, trace=trace, batch_invariant=batch_invariant)
    return float(temperature)


def token_logprobs(model: Any, spec: ArchSpec, hidden_TD: torch.Tensor, labels_T: torch.Tensor, *,
                   temperature: float, entropy: bool, trace: Counter | None = None,
                   batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token fp32 log-probs (and entropy) at the predicting positions, through the fused head."""
    head = output_layer(model)
    params = head_params(model, spec)
    return call_as_forward(head, lambda: linear_logprob_entropy(
        hidden_TD, head.weight, labels_T.clamp(min=0), temperature=temperature / params.scale, entropy=entropy,
        softcap=params.softcap, trace=trace, batch_invariant=batch_invariant))


def token_loss(model: Any, spec: ArchSpec, hidden_TD: torch.Tensor, labels_T: torch.Tensor, loss_fn: Any,
               token_args: tuple, *, temperature: float, entropy: bool, trace: Counter | None = None,
               batch_invariant: bool = False) -> LossOutput:
    """``linear_logprob_loss`` through the model's output layer and its head transforms."""
    head = output_layer(model)
    params = head_params(model, spec)
    return call_as_forward(head, lambda: linear_logprob_loss(
        hidden_TD, head.weight, labels_T.clamp(min=0), loss_fn, token_args=token_args,
        temperature=temperature / params.scale, entropy=entropy, softcap=params.softcap, trace=trace,
        batch_invariant=batch_invariant))
