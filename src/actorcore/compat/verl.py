"""verl-compatible entry point: ``apply_monkey_patch`` and a patched forward returning log-probs/entropy.

Switch with ``from actorcore.compat.verl import apply_monkey_patch``. Everything runs through actorcore's own
API (``patch_model``, ``compute_logprobs``); there is no second implementation.

Contract of the patched forward (verl's remove-padding layout):
- ``input_ids`` and ``position_ids`` are ``(1, total_nnz)``: every sequence concatenated, no padding.
- Sequence boundaries come from ``position_ids``: a sequence starts at token 0, wherever the position is 0,
  and wherever it does not continue the previous position by one. ``attention_mask`` must be ``None``.
- Under Ulysses SP every rank of the SP group passes the SAME full ``(1, total_nnz)`` tensors and gets the
  full outputs back: skip verl's ``ulysses_pad_and_slice_inputs`` / ``gather_outputs_and_unpad`` (actorcore
  pads, shards and gathers inside, and scores each shard's last token against the next shard's first).
- ``use_fused_kernels=True``: the output has ``log_probs`` and ``entropy`` ``(1, total_nnz)``, float32, at
  verl's alignment: position ``t`` holds ``log p(input_ids[t + 1])`` (the token it predicts), and 0 at the
  last token of each sequence (which predicts nothing in its own sequence). ``temperature`` divides the logits.
- ``use_fused_kernels=False``: the output has ``logits`` ``(1, total_nnz, vocab)`` from the packed decoder
  (temperature is left to the caller, as in verl).
- Zero tokens (``input_ids`` of shape ``(1, 0)``) is a ``ValueError``, not an empty output: verl never runs an
  empty micro-batch, and a rank that skipped the decoder would leave the other ranks' FSDP collectives waiting.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from actorcore.batch import PackedBatch, cu_seqlens_from_lengths
from actorcore.hf.patch import PatchHandle, patch_model
from actorcore.parallel import ParallelContext

logger = logging.getLogger(__name__)

FUSED_KERNELS_BACKENDS = (None, "torch", "triton")


@functools.cache
def _output_class():
    """Made once (it imports transformers, which ``import actorcore.compat.verl`` must not)."""
    from transformers.utils import ModelOutput

    @dataclass
    class CausalLMOutputForPPO(ModelOutput):
        """verl's output fields: ``log_probs`` / ``entropy`` (fused kernels) or ``logits``."""

        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        log_probs: torch.Tensor | None = None
        entropy: torch.Tensor | None = None

    return CausalLMOutputForPPO


def batch_from_position_ids(input_ids: torch.Tensor, position_ids: torch.Tensor) -> PackedBatch:
    """``(1, total_nnz)`` ids and positions -> PackedBatch, sequences split where positions restart."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be (1, total_nnz) (verl's remove-padding layout), got {got}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids holds no tokens (shape (1, 0)): verl never runs an empty micro-batch (every "
                         "sequence holds at least its prompt); drop empty micro-batches before the forward")
    if position_ids is None:
        raise ValueError("position_ids are required: sequence boundaries are read from where they restart")
    if position_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids must be (1, total_nnz) like input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(position_ids.shape)}; M-RoPE position ids are not supported by this entry point")
    ids, pos = input_ids[0], position_ids[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = (pos[1:] == 0) | (pos[1:] != pos[:-1] + 1)
    start_idx = starts.nonzero()[:, 0].tolist() + [ids.numel()]
    lengths = [b - a for a, b in zip(start_idx[:-1], start_idx[1:])]
    return PackedBatch(input_ids=ids.long(), position_ids=pos.long(),
                       cu_seqlens=cu_seqlens_from_lengths(lengths, device=ids.device), max_seqlen=max(lengths))


def to_predicting_position(scored_T: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """actorcore's scored-token alignment -> verl's: ``out[t] = scored[t + 1]``, 0 at each sequence's end."""
    out = torch.zeros_like(scored_T)
    out[:-1] = scored_T[1:]
    return out.index_fill(0, (batch.cu_seqlens[1:] - 1).long(), 0.0)


def _context(ulysses_sp_size: int, sp_group: Any, parallel: Any) -> ParallelContext | None:
    if not isinstance(ulysses_sp_size, int) or ulysses_sp_size < 1:
        raise ValueError(f"ulysses_sp_size must be a positive int, got {ulysses_sp_size!r}")
    if sp_group is not None and parallel is not None:
        raise ValueError("pass either sp_group or parallel, not both")
    ctx = ParallelContext(sp_group=sp_group) if sp_group is not None else parallel
    have = 1 if ctx is None else ctx.sp_size
    if have != ulysses_sp_size:
        if ulysses_sp_size > 1 and ctx is None:
            raise ValueError(f"ulysses_sp_size={ulysses_sp_size} needs the SP group: pass sp_group= (e.g. "
                             "device_mesh['sp'].get_group()) or parallel=ParallelContext.from_device_mesh(...)")
        raise ValueError(f"ulysses_sp_size={ulysses_sp_size} but the given SP group has {have} ranks")
    return ctx


def apply_monkey_patch(model: torch.nn.Module, ulysses_sp_size: int = 1, use_remove_padding: bool = True,
                       use_fused_kernels: bool = False, fused_kernels_backend: str | None = None,
                       use_tiled_mlp: bool = False, tiled_mlp_shards: int = 4, *, sp_group: Any = None,
                       parallel: ParallelContext | None = None) -> PatchHandle:
    """Patch this model instance the way verl's ``apply_monkey_patch`` does, reversibly.

    ``ulysses_sp_size``: Ulysses SP degree (needs ``sp_group`` or ``parallel`` of that size and remove-padding);
    ``use_remove_padding``: packed ``(1, total_nnz)`` inputs, boundaries from ``position_ids``;
    ``use_fused_kernels``: the forward returns ``log_probs`` / ``entropy`` without materialising logits;
    ``fused_kernels_backend``: None/"torch"/"triton", accepted for compatibility; actorcore chooses the kernel
    itself (Triton on CUDA when installed, its chunked torch kernel otherwise), and "triton" is refused where
    triton is not installed; ``use_tiled_mlp`` / ``tiled_mlp_shards``: tiled MLP.
    Returns the ``PatchHandle``; ``handle.revert()`` restores the model.
    """
    ctx = _context(ulysses_sp_size, sp_group, parallel)
    if ulysses_sp_size > 1 and not use_remove_padding:
        raise ValueError("Ulysses sequence parallelism needs use_remove_padding=True (packed sequences), as in verl")
    if fused_kernels_backend not in FUSED_KERNELS_BACKENDS:
        raise ValueError(f"fused_kernels_backend must be one of {FUSED_KERNELS_BACKENDS}, got {fused_kernels_backend!r}")
    if fused_kernels_backend == "triton" and use_fused_kernels:
        from actorcore.kernels.logprob.api import triton_importable

        if not triton_importable():
            raise ValueError("fused_kernels_backend='triton' but triton is not installed; use 'torch'")
    shards = tiled_mlp_shards if use_tiled_mlp else None
    handle = patch_model(model, parallel=ctx if ulysses_sp_size > 1 else None, tiled_mlp_shards=shards)
    if use_remove_padding or use_fused_kernels:
        _install_forward(handle, model, ctx if ulysses_sp_size > 1 else None, use_fused_kernels)
    logger.info("verl-style patch: ulysses_sp_size=%d remove_padding=%s fused_kernels=%s tiled_mlp=%s",
                ulysses_sp_size, use_remove_padding, use_fused_kernels, shards)
    return handle


class VerlForward:
    """The instance ``forward`` installed by ``apply_monkey_patch``: verl's packed forward (module docstring).

    An object holding its model (not a closure over it), so ``copy.deepcopy`` / ``torch.save`` of the model give
    a copy whose forward runs the copy's weights. ``parallel`` is shared by copies (a ``ParallelContext`` holds
    process-wide groups; pickling one with groups is refused).
    """

    def __init__(self, model: torch.nn.Module, parallel: ParallelContext | None, fused: bool) -> None:
        self.model = model
        self.parallel = parallel
        self.fused = fused

    def __call__(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temperature: float = 1.0, labels: Any = None,
                 **unused: Any):
        """Packed forward; runs inside ``model(...)`` so FSDP hooks apply."""
        from actorcore.hf.logprobs import logprobs_inside_forward

        if attention_mask is not None:
            raise ValueError("the remove-padding forward takes attention_mask=None; sequences are delimited by "
                             "position_ids restarts")
        if labels is not None:
            raise ValueError("labels are not accepted: they are taken from input_ids within each sequence")
        for key in ("inputs_embeds", "pixel_values"):
            if unused.get(key) is not None:
                raise ValueError(f"{key} is not supported by actorcore's verl entry point")
        batch = batch_from_position_ids(input_ids, position_ids)
        output_class = _output_class()
        if self.fused:
            out = logprobs_inside_forward(self.model, batch, temperature=temperature, entropy=True,
                                          parallel=self.parallel)
            return output_class(log_probs=to_predicting_position(out.log_probs, batch)[None],
                                entropy=to_predicting_position(out.entropy, batch)[None])
        return output_class(logits=_packed_logits(self.model, batch, self.parallel)[None])


def _install_forward(handle: PatchHandle, model: torch.nn.Module, ctx: Any, fused: bool) -> None:
    had_own = "forward" in model.__dict__
    previous = model.__dict__.get("forward")

    def restore() -> None:
        if had_own:
            model.__dict__["forward"] = previous
        else:
            model.__dict__.pop("forward", None)

    handle.add_undo(restore)
    model.__dict__["forward"] = VerlForward(model, ctx, fused)


def _packed_logits(model: torch.nn.Module, batch: PackedBatch, ctx: Any) -> torch.Tensor:
    """Full ``[T, V]`` logits from the packed decoder (gathered over SP), for callers that want logits."""
    from actorcore.archs import spec_for_model
    from actorcore.batch import unpad
    from actorcore.hf.decoder import run_decoder
    from actorcore.hf.head import head_params
    from actorcore.hf.logprobs import gather_sp

    spec = spec_for_model(model)
    hidden_TD, work = run_decoder(model, spec, batch, ctx)
    logits_TV = model.get_output_embeddings()(unpad(gather_sp(hidden_TD, ctx), work))
    return head_params(model, spec).apply(logits_TV)
