"""Per-token log-probs, entropy and values for Hugging Face models on packed batches.

Legend: ``T`` packed tokens (this rank's shard under SP), ``D`` hidden, ``V`` vocab.

One decoder pass over the packed batch (packed attention: no padding, no cross-sequence attention), then a
fused head that never builds ``[T, V]`` logits. Under Ulysses sequence parallelism (``parallel`` with
``sp_size > 1``, model patched by ``patch_model``) each rank runs the decoder on its shard of the padded
batch; labels come from the full batch before sharding, so a shard's last token is scored against the next
shard's first token; outputs are gathered so every rank returns the full ``[T]``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

from actorcore.archs import ArchSpec, spec_for_model
from actorcore.batch import (
    PackedBatch,
    next_token_labels,
    pad_to_multiple,
    shard_for_sp,
    shift_to_scored_token,
    unpad,
)
from actorcore.hf.attention import (
    CALLS,
    PackingNotAppliedError,
    attention_configs,
    packed_attention,
    current_implementations,
    register_attention,
)
from actorcore.kernels.logprob import linear_logprob_entropy
from actorcore.outputs import LogProbOutput

logger = logging.getLogger(__name__)


def resolve(obj: Any, dotted: str) -> Any:
    """Follow a dotted attribute path from an arch spec, with an error that names the missing step."""
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise AttributeError(
                f"{type(obj).__name__} has no attribute {part!r} (path {dotted!r} from the arch spec); the "
                "installed transformers lays this model out differently: update the spec in actorcore/archs/"
            )
        obj = getattr(obj, part)
    return obj


def _sp_size(parallel: Any) -> int:
    return 1 if parallel is None else int(parallel.sp_size)


def _check_inputs(model: Any, batch: PackedBatch) -> PackedBatch:
    if not isinstance(batch, PackedBatch):
        raise ValueError(f"batch must be an actorcore.PackedBatch (use ac.pack / ac.pack_padded), got "
                         f"{type(batch).__name__}")
    embeddings = model.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None)
    if vocab is not None and not batch.input_ids.is_cuda:
        low, high = int(batch.input_ids.min()), int(batch.input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"token ids span [{low}, {high}] but the model's vocabulary has {vocab} entries")
    device = embeddings.weight.device
    return batch if batch.device == device else batch.to(device)


def _decoder_inputs(batch: PackedBatch, parallel: Any) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
    """The (padded) batch the decoder sees and this rank's input ids / position ids."""
    sp = _sp_size(parallel)
    if sp == 1:
        return batch, batch.input_ids, batch.position_ids
    work = pad_to_multiple(batch, sp)
    rank = int(parallel.sp_rank)
    return work, shard_for_sp(work.input_ids, rank, sp), shard_for_sp(work.position_ids, rank, sp)


def run_decoder(model: Any, spec: ArchSpec, batch: PackedBatch, parallel: Any = None,
                **decoder_kwargs: Any) -> tuple[torch.Tensor, PackedBatch]:
    """Packed decoder pass; returns this rank's final hidden states ``[T, D]`` and the batch as run.

    Raises ``PackingNotAppliedError`` if the packed attention did not run in every layer.
    """
    decoder = resolve(model, spec.decoder)
    layers = resolve(decoder, spec.layers)
    configs = attention_configs(layers, spec.attention)
    work, input_ids, position_ids = _decoder_inputs(batch, parallel)
    if _sp_size(parallel) > 1:
        from actorcore.hf.patch import require_sequence_parallel_patch

        require_sequence_parallel_patch(model, parallel)
        switch = contextlib.nullcontext()
    elif all(name and name.startswith("actorcore_") for name in current_implementations(configs)):
        switch = contextlib.nullcontext()  # patched with an actorcore attention already (e.g. sp_size=1)
    else:
        switch = packed_attention(decoder, configs, register_attention())
    cu = work.cu_seqlens
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids.unsqueeze(1),
        use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=work.max_seqlen,
        max_length_k=work.max_seqlen,
    )
    if spec.vision is not None:
        from actorcore.hf.vlm import vlm_decoder_inputs

        kwargs.update(vlm_decoder_inputs(model, spec, work, parallel))
    kwargs.update(decoder_kwargs)
    if "inputs_embeds" in kwargs:
        kwargs.pop("input_ids")
    calls_before = sum(CALLS.values())
    with switch:
        out = decoder(**kwargs)
    if sum(CALLS.values()) - calls_before < len(layers):
        raise PackingNotAppliedError(
            f"packed attention ran {sum(CALLS.values()) - calls_before} times for {len(layers)} layers: the "
            "installed transformers bypassed actorcore's attention; refusing to return unpacked results"
        )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0], work


def _gather(local_T: torch.Tensor, parallel: Any) -> torch.Tensor:
    if _sp_size(parallel) == 1:
        return local_T
    from actorcore.parallel.collectives import gather_sp

    return gather_sp(local_T, parallel)


def _final_logit_softcap(model: Any, spec: ArchSpec) -> float | None:
    if spec.final_logit_softcap_field is None:
        return None
    config = model.config
    value = getattr(config, spec.final_logit_softcap_field, None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), spec.final_logit_softcap_field, None)
    return float(value) if value else None


def _check_lm_head(model: Any, head: Any) -> None:
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm head); compute_logprobs needs a "
                         "...ForCausalLM model")
    if getattr(head, "bias", None) is not None:
        raise ValueError("the lm head has a bias, which actorcore's fused log-prob head does not support")


def _check_temperature(temperature: float) -> float:
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    return float(temperature)


def call_as_forward(module: torch.nn.Module, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as ``module``'s forward, so hooks on the module run around it.

    FSDP2 unshards a module's parameters in its forward pre-hook and arranges their gradient reduction in its
    post-hook; calling sub-modules or reading ``module.weight`` outside ``module(...)`` would see shards.
    The instance's ``forward`` is replaced for this one call and restored.
    """
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = _run_thunk
    try:
        # Passed as a keyword, not as no arguments: torch 2.11's FSDP2 root pre-forward indexes args[0].
        return module(actorcore_thunk=fn)
    finally:
        if had_own:
            module.forward = own
        else:
            del module.forward


def _run_thunk(actorcore_thunk: Callable[[], Any]) -> Any:
    return actorcore_thunk()


def compute_logprobs(model: Any, batch: PackedBatch, temperature: float = 1.0, entropy: bool = True,
                     parallel: Any = None, **decoder_kwargs: Any) -> LogProbOutput:
    """Exact per-token log-probs (and entropy) of ``batch`` under ``model``, float32 ``[T]``.

    ``log_probs[t] = log softmax(logits_{t-1} / temperature)[input_ids[t]]`` within each sequence; 0 at every
    sequence's first token. Differentiable (actor update) or under ``torch.no_grad()`` (old/ref log-probs).
    Runs as the model's forward (FSDP2 / DDP hooks apply).
    """
    temperature = _check_temperature(temperature)
    spec_for_model(model)
    batch = _check_inputs(model, batch)
    return call_as_forward(model, lambda: logprobs_inside_forward(
        model, batch, temperature=temperature, entropy=entropy, parallel=parallel, **decoder_kwargs))


def logprobs_inside_forward(model: Any, batch: PackedBatch, temperature: float = 1.0, entropy: bool = True,
                            parallel: Any = None, **decoder_kwargs: Any) -> LogProbOutput:
    """``compute_logprobs`` for callers already inside the model's forward (e.g. a patched forward)."""
    spec = spec_for_model(model)
    head = model.get_output_embeddings()
    _check_lm_head(model, head)
    softcap = _final_logit_softcap(model, spec)

    hidden_TD, work = run_decoder(model, spec, batch, parallel, **decoder_kwargs)
    labels_T, valid_T = next_token_labels(work)
    if _sp_size(parallel) > 1:
        labels_T = shard_for_sp(labels_T, int(parallel.sp_rank), _sp_size(parallel))
    logprob_T, entropy_T = call_as_forward(head, lambda: linear_logprob_entropy(
        hidden_TD, head.weight, labels_T.clamp(min=0), temperature=temperature, entropy=entropy, softcap=softcap))
    logprob_T = _finish(_gather(logprob_T, parallel), valid_T, work)
    if entropy_T is not None:
        entropy_T = _finish(_gather(entropy_T, parallel), valid_T, work)
    return LogProbOutput(log_probs=logprob_T, entropy=entropy_T)


def _finish(predicting_T: torch.Tensor, valid_T: torch.Tensor, work: PackedBatch) -> torch.Tensor:
    """Zero predictions that cross a sequence boundary, drop padding, move to the scored token."""
    kept = torch.where(valid_T, predicting_T, torch.zeros_like(predicting_T))
    return shift_to_scored_token(unpad(kept, work))


def compute_values(model: Any, batch: PackedBatch, parallel: Any = None, **decoder_kwargs: Any) -> torch.Tensor:
    """Per-token values ``[T]`` (float32) from a 1-label ``...ForTokenClassification`` critic.

    ``values[t]`` is the critic's output at token ``t`` itself (no shift), as the HF model computes it; the
    head runs in float32.
    """
    spec = spec_for_model(model)
    batch = _check_inputs(model, batch)
    head = getattr(model, spec.value_head, None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(
            f"compute_values needs a critic with a 1-output '{spec.value_head}' head (e.g. "
            f"AutoModelForTokenClassification with num_labels=1); {type(model).__name__} has {head!r}"
        )
    return call_as_forward(model, lambda: _values_inside_forward(model, spec, head, batch, parallel, decoder_kwargs))


def _values_inside_forward(model, spec, head, batch, parallel, decoder_kwargs) -> torch.Tensor:
    hidden_TD, work = run_decoder(model, spec, batch, parallel, **decoder_kwargs)
    dropout = getattr(model, "dropout", None)
    if isinstance(dropout, torch.nn.Module):
        hidden_TD = dropout(hidden_TD)

    def value_head() -> torch.Tensor:
        bias = head.bias.float() if head.bias is not None else None
        return torch.nn.functional.linear(hidden_TD.float(), head.weight.float(), bias)[:, 0]

    return unpad(_gather(call_as_forward(head, value_head), parallel), work)
