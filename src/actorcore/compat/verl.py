"""verl-compatible entry point: ``apply_monkey_patch`` and a patched forward returning log-probs/entropy.

Switch with ``from actorcore.compat.verl import apply_monkey_patch``: same arguments in the same order as
verl's (0.7 to 0.9). Everything runs through actorcore's own API (``patch_model``, the packed decoder, the
fused head, ``compute_values``' path); there is no second implementation.

Contract of the patched forward (verl's remove-padding layout):
- ``input_ids`` and ``position_ids`` are ``(1, total_nnz)``: every sequence concatenated, no padding.
- Sequence boundaries come from ``position_ids``: a sequence starts at token 0, wherever the position is 0,
  and wherever it does not continue the previous position by one. ``attention_mask`` must be ``None``.
- Under Ulysses SP (verl's contract): each rank of the SP group passes ITS slice ``(1, total_nnz_padded / sp)``
  of the padded inputs (verl's ``ulysses_pad_and_slice_inputs``) and gets ITS slice of the outputs back (verl
  gathers them with ``gather_outputs_and_unpad``). The forward all-gathers the id/position slices, finds the
  boundaries on the whole batch, runs actorcore's SP path, and returns this rank's slice. The SP group is
  ``sp_group=`` / ``parallel=`` if given, else verl's own (``verl.utils.ulysses.get_ulysses_sequence_parallel_group``,
  read at each call).
- ``use_fused_kernels=True``: the output has ``log_probs`` and ``entropy`` ``(1, total_nnz)``, float32, at
  verl's alignment: position ``t`` holds ``log p(input_ids[t + 1])`` (the token it predicts), and 0 at the
  last token of each sequence (which predicts nothing in its own sequence). ``temperature`` divides the logits.
- ``use_fused_kernels=False``: the output has ``logits`` ``(1, total_nnz, vocab)`` from the packed decoder
  (temperature is left to the caller, as in verl). The tensor is fresh (no view of anything autograd or
  FSDP holds), so verl's in-place ``logits.div_(temperature)`` keeps the backward hooks FSDP registered on it.
- Critics and reward models (``...ForTokenClassification`` / ``...ForSequenceClassification`` with one label):
  ``logits`` is ``(1, total_nnz, 1)``, the float32 value at every token, as verl's critic reads it.
- ``use_remove_padding=False`` with ``use_fused_kernels=True`` (verl's padded path): ``input_ids``,
  ``attention_mask`` and ``position_ids`` are ``[B, S]`` rows (left and/or right padding, one contiguous run of
  real tokens each); the rows are packed without their padding and ``log_probs`` / ``entropy`` come back
  ``[B, S]`` float32 in the rows' own layout, at verl's alignment (position ``t`` holds ``log p(input_ids[t + 1])``),
  0 at padding and at each row's last real token. Without fused kernels verl's padded path runs the model's own
  forward (nothing is installed).
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
from actorcore.hf.patch import PatchHandle, install_plan, plan_patch
from actorcore.parallel import ParallelContext

logger = logging.getLogger(__name__)

# verl 0.7 accepts None/"torch"/"triton"; verl 0.9 adds "liger". actorcore's own fused head serves them all.
FUSED_KERNELS_BACKENDS = (None, "torch", "triton", "liger")


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


class VerlUlyssesGroup:
    """A ``ParallelContext``-shaped SP context whose group is verl's, read at each call.

    verl sets its Ulysses group (``verl.utils.ulysses.set_ulysses_sequence_parallel_group``) inside its sharding
    manager, after ``apply_monkey_patch`` ran, so the group cannot be taken at patch time. Holds only the size.
    """

    def __init__(self, size: int) -> None:
        self.size = size

    @property
    def sp_size(self) -> int:
        return self.size

    def resolve(self) -> ParallelContext:
        """A ``ParallelContext`` on verl's current Ulysses group, of the size given at patch time."""
        from verl.utils.ulysses import get_ulysses_sequence_parallel_group

        group = get_ulysses_sequence_parallel_group()
        if group is None:
            raise ValueError(f"apply_monkey_patch(ulysses_sp_size={self.size}) reads verl's Ulysses group at each "
                             "call, but verl has not set one: run the forward inside verl's sharding manager (which "
                             "calls set_ulysses_sequence_parallel_group), or patch with sp_group= / parallel=")
        ctx = ParallelContext(sp_group=group)
        if ctx.sp_size != self.size:
            raise ValueError(f"the model was patched with ulysses_sp_size={self.size} but verl's Ulysses group has "
                             f"{ctx.sp_size} ranks; patch with the size of verl's group")
        return ctx


def _verl_ulysses_importable() -> bool:
    try:
        import verl.utils.ulysses  # noqa: F401
    except ImportError:
        return False
    return True


def _context(ulysses_sp_size: int, sp_group: Any, parallel: Any) -> Any:
    """The SP context of the patch: None (no SP), a ``ParallelContext``, or a ``VerlUlyssesGroup``."""
    if isinstance(ulysses_sp_size, bool) or not isinstance(ulysses_sp_size, int) or ulysses_sp_size < 1:
        raise ValueError(f"ulysses_sp_size must be a positive int, got {ulysses_sp_size!r}")
    if sp_group is not None and parallel is not None:
        raise ValueError("pass either sp_group or parallel, not both")
    ctx = ParallelContext(sp_group=sp_group) if sp_group is not None else parallel
    if ctx is None and ulysses_sp_size > 1:
        if _verl_ulysses_importable():
            logger.info("ulysses_sp_size=%d: the SP group is verl's (get_ulysses_sequence_parallel_group), read "
                        "at each call", ulysses_sp_size)
            return VerlUlyssesGroup(ulysses_sp_size)
        raise ValueError(f"ulysses_sp_size={ulysses_sp_size} needs the SP group and verl is not importable: pass "
                         "sp_group= (e.g. device_mesh['sp'].get_group()) or "
                         "parallel=ParallelContext.from_device_mesh(...)")
    have = 1 if ctx is None else ctx.sp_size
    if have != ulysses_sp_size:
        raise ValueError(f"ulysses_sp_size={ulysses_sp_size} but the given SP group has {have} ranks")
    return ctx if ulysses_sp_size > 1 else None


def _is_critic(model: torch.nn.Module) -> bool:
    """A one-label value model (``...ForTokenClassification`` / ``...ForSequenceClassification``): no LM head."""
    from actorcore.archs import spec_for_model

    if model.get_output_embeddings() is not None:
        return False
    head = getattr(model, spec_for_model(model).value_head, None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has neither an LM head nor a value head "
                         f"'{spec_for_model(model).value_head}'; apply_monkey_patch serves causal LMs and critics")
    if head.out_features != 1:
        raise ValueError(f"{type(model).__name__} has {head.out_features} labels; verl's critic and reward model "
                         "read one value per token: build it with num_labels=1")
    return True


# The patch_model options verl's loop asks for by default, and why (shown in the handle's plan). A caller passes
# any patch_model option through apply_monkey_patch's keywords (functools.partial where verl calls it), which
# replaces these.
VERL_PLAN = {"compiled_decoder": False, "moe_experts": False, "swiglu_mlp": False}
VERL_REASONS = {
    "compiled_decoder": "compat.verl: verl calls apply_monkey_patch on the actor it built on the CPU in fp32, before "
                        "FSDP moves and casts it, so the device and dtype the compiled decoder decides from are not "
                        "those it runs with, and verl's own tests (CPU) cannot run compiled layers under its FSDP "
                        "wrapping",
    "moe_experts": "compat.verl: actorcore's experts path has not run under verl's FSDP wrapping (it is exact on "
                   "any device: pass moe_experts='sorted' to take it)",
    "swiglu_mlp": "compat.verl: quack's gated MLP is taken with the compiled decoder, which verl's plan leaves off",
}


def apply_monkey_patch(model: torch.nn.Module, ulysses_sp_size: int = 1, use_remove_padding: bool = True,
                       use_fused_kernels: bool = False, fused_kernels_backend: str | None = None,
                       use_prefix_grouper: bool = False, use_tiled_mlp: bool = False, tiled_mlp_shards: int = 4,
                       *, sp_group: Any = None, parallel: ParallelContext | None = None,
                       **options: Any) -> PatchHandle:
    """Patch this model instance the way verl's ``apply_monkey_patch`` does, reversibly.

    Arguments in verl's order (0.7.1 to 0.9.1): ``ulysses_sp_size``: Ulysses SP degree (the group is ``sp_group``
    / ``parallel`` if given, else verl's own, read at each call); ``use_remove_padding``: packed
    ``(1, total_nnz)`` inputs, boundaries from ``position_ids``; ``use_fused_kernels``: the forward returns
    ``log_probs`` / ``entropy`` without materialising logits; ``fused_kernels_backend``: None/"torch"/"triton"/
    "liger", accepted for compatibility: actorcore's own fused head serves them all (Triton on CUDA when
    installed, its chunked torch kernel otherwise), and "triton" is refused where triton is not installed;
    ``use_prefix_grouper``: refused (not implemented); ``use_tiled_mlp`` / ``tiled_mlp_shards``: tiled MLP.
    ``options``: any other ``patch_model`` option (``checkpointing="auto", memory_budget_gib=...``,
    ``offload_activations``, ``recompute_norms``, ``compiled_decoder``, ...), the same plan ``patch_model`` builds;
    by default verl's loop runs the eager decoder and the model's own MLP and experts code (``VERL_REASONS``
    says why, and so does ``handle.plan``). Returns the ``PatchHandle``; ``handle.revert()`` restores the model.
    """
    if use_prefix_grouper:
        raise ValueError("use_prefix_grouper=True is not supported by actorcore's apply_monkey_patch (it does not "
                         "implement verl's PrefixGrouper shared-prefix attention); set use_prefix_grouper=False in "
                         "the actor's model config, or use verl's own apply_monkey_patch for that run")
    ctx = _context(ulysses_sp_size, sp_group, parallel)
    if ulysses_sp_size > 1 and not use_remove_padding:
        raise ValueError("Ulysses sequence parallelism needs use_remove_padding=True (packed sequences), as in verl")
    if fused_kernels_backend not in FUSED_KERNELS_BACKENDS:
        raise ValueError(f"fused_kernels_backend must be one of {FUSED_KERNELS_BACKENDS}, got {fused_kernels_backend!r}")
    if fused_kernels_backend == "triton" and use_fused_kernels:
        from actorcore.kernels.logprob.api import triton_importable

        if not triton_importable():
            raise ValueError("fused_kernels_backend='triton' but triton is not installed; use 'torch'")
    if fused_kernels_backend == "liger" and use_fused_kernels:
        logger.info("fused_kernels_backend='liger': served by actorcore's fused log-prob head (liger is not used)")
    critic = _is_critic(model)
    if critic and use_fused_kernels:
        raise ValueError(f"{type(model).__name__} is a value model (critic / reward model): it has no log-probs, so "
                         "use_fused_kernels=True does not apply; patch it with use_fused_kernels=False")
    shards = tiled_mlp_shards if use_tiled_mlp else None
    if "tiled_mlp_shards" in options or "parallel" in options:
        raise TypeError("apply_monkey_patch() takes tiled MLP as use_tiled_mlp / tiled_mlp_shards and the SP group "
                        "as ulysses_sp_size with sp_group= or parallel=, in verl's way")
    asked = {**VERL_PLAN, "tiled_mlp_shards": shards, **options}
    reasons = {k: why for k, why in VERL_REASONS.items() if k not in options}
    plan = plan_patch(model, ctx, by="compat.verl", reasons=reasons, **asked)
    handle = install_plan(model, plan, ctx)
    if use_remove_padding or use_fused_kernels:
        kind = "values" if critic else "log_probs" if use_fused_kernels else "logits"
        _install_forward(handle, model, ctx, kind, padded=not use_remove_padding)
    logger.info("verl-style patch: ulysses_sp_size=%d remove_padding=%s fused_kernels=%s tiled_mlp=%s critic=%s",
                ulysses_sp_size, use_remove_padding, use_fused_kernels, shards, critic)
    return handle


class VerlForward:
    """The instance ``forward`` installed by ``apply_monkey_patch``: verl's packed forward (module docstring).

    An object holding its model (not a closure over it), so ``copy.deepcopy`` / ``torch.save`` of the model give
    a copy whose forward runs the copy's weights. ``parallel`` is shared by copies (a ``ParallelContext`` holds
    process-wide groups; pickling one with groups is refused). ``kind``: "log_probs", "logits" or "values".
    """

    def __init__(self, model: torch.nn.Module, parallel: Any, kind: str, padded: bool = False) -> None:
        self.model = model
        self.parallel = parallel
        self.kind = kind
        self.padded = padded  # verl's padded [B, S] layout (use_remove_padding=False, fused kernels)

    def __call__(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temperature: float = 1.0, labels: Any = None,
                 shift_labels: torch.Tensor | None = None, **unused: Any):
        """Packed forward; runs inside ``model(...)`` so FSDP hooks apply."""
        from actorcore.hf.logprobs import logprobs_inside_forward, values_inside_forward

        if self.padded:
            return self._padded_log_probs(input_ids, attention_mask, position_ids, temperature, labels, shift_labels,
                                          unused)
        if attention_mask is not None:
            raise ValueError("the remove-padding forward takes attention_mask=None; sequences are delimited by "
                             "position_ids restarts")
        if labels is not None:
            raise ValueError("labels are not accepted: they are taken from input_ids within each sequence")
        for key in ("inputs_embeds", "pixel_values"):
            if unused.get(key) is not None:
                raise ValueError(f"{key} is not supported by actorcore's verl entry point")
        ctx = self.parallel.resolve() if isinstance(self.parallel, VerlUlyssesGroup) else self.parallel
        if ctx is not None:
            _check_slice(input_ids, position_ids)
            if shift_labels is not None:
                _check_slice(input_ids, shift_labels, "shift_labels")
                shift_labels = _gather_slices(shift_labels, ctx)
            input_ids, position_ids = _gather_slices(input_ids, ctx), _gather_slices(position_ids, ctx)
        batch = batch_from_position_ids(input_ids, position_ids)
        if shift_labels is not None:
            _check_shift_labels(shift_labels, batch)
        output_class = _output_class()
        if self.kind == "log_probs":
            out = logprobs_inside_forward(self.model, batch, temperature=temperature, entropy=True, parallel=ctx)
            return output_class(log_probs=_my_slice(to_predicting_position(out.log_probs, batch), ctx)[None],
                                entropy=_my_slice(to_predicting_position(out.entropy, batch), ctx)[None])
        if self.kind == "values":
            values_T = values_inside_forward(self.model, batch, parallel=ctx)
            return output_class(logits=_my_slice(values_T, ctx)[None, :, None])
        return output_class(logits=_packed_logits(self.model, batch, ctx))


    def _padded_log_probs(self, input_ids: Any, attention_mask: Any, position_ids: Any, temperature: float,
                          labels: Any, shift_labels: Any, unused: dict) -> Any:
        """verl's padded fused forward: pack the ``[B, S]`` rows, score them, return ``[B, S]`` in their layout."""
        from actorcore.batch import packed_to_grid
        from actorcore.hf.logprobs import logprobs_inside_forward

        if labels is not None or shift_labels is not None:
            raise ValueError("labels / shift_labels are not accepted: each token's label is the next token of its row")
        for key in ("inputs_embeds", "pixel_values"):
            if unused.get(key) is not None:
                raise ValueError(f"{key} is not supported by actorcore's verl entry point")
        batch = _batch_from_padded(input_ids, attention_mask, position_ids)
        out = logprobs_inside_forward(self.model, batch, temperature=temperature, entropy=True, parallel=None)
        return _output_class()(
            log_probs=packed_to_grid(to_predicting_position(out.log_probs, batch), attention_mask),
            entropy=packed_to_grid(to_predicting_position(out.entropy, batch), attention_mask))


def _batch_from_padded(input_ids: Any, attention_mask: Any, position_ids: Any) -> PackedBatch:
    """verl's padded ``[B, S]`` rows -> PackedBatch; the given positions must count 0, 1, ... over each row's
    real tokens (what verl computes from the mask), checked where it costs no device sync (not on CUDA)."""
    from actorcore.batch import pack_padded

    if attention_mask is None:
        raise ValueError("use_remove_padding=False: the forward needs verl's [B, S] attention_mask (it says where "
                         "each row's padding is); got None")
    batch = pack_padded(input_ids, attention_mask)
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.shape != input_ids.shape:
            got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
            raise ValueError(f"position_ids must be [B, S] like input_ids {tuple(input_ids.shape)}, got {got}; "
                             "M-RoPE position ids are not supported by this entry point")
        if not position_ids.is_cuda and not torch.equal(position_ids[attention_mask.bool()].long().cpu(),
                                                        batch.position_ids.cpu()):
            raise ValueError("position_ids do not count 0, 1, ... over each row's real tokens (verl's "
                             "cumsum(attention_mask) - 1); actorcore restarts positions at every row's first token")
    return batch


def _check_slice(input_ids: Any, other: Any, name: str = "position_ids") -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be this rank's (1, total_nnz_padded / sp) slice (verl's "
                         f"ulysses_pad_and_slice_inputs), got {got}")
    if not isinstance(other, torch.Tensor) or other.shape != input_ids.shape:
        raise ValueError(f"under Ulysses SP, {name} must be this rank's slice, shaped like input_ids "
                         f"{tuple(input_ids.shape)} (verl's ulysses_pad_and_slice_inputs slices both)")


def _check_shift_labels(shift_labels: Any, batch: PackedBatch) -> None:
    """verl 0.9 passes ``shift_labels`` (its rolled ``input_ids``) to a fused forward. actorcore takes each label
    from the next token of the same sequence, which is what verl's are wherever they are read (not at a sequence's
    last token); labels that differ elsewhere are refused. Checked where it costs no device sync (not on CUDA)."""
    if not isinstance(shift_labels, torch.Tensor) or tuple(shift_labels.shape) != (1, batch.num_tokens):
        got = tuple(shift_labels.shape) if isinstance(shift_labels, torch.Tensor) else type(shift_labels).__name__
        raise ValueError(f"shift_labels must be (1, total_nnz) like input_ids, got {got}")
    if shift_labels.is_cuda:
        return
    inner = torch.ones(batch.num_tokens, dtype=torch.bool)
    inner[(batch.cu_seqlens[1:] - 1).long().cpu()] = False
    next_token = torch.roll(batch.input_ids, -1).cpu()
    if not torch.equal(shift_labels[0].cpu()[inner], next_token[inner]):
        raise ValueError("shift_labels differ from the next token within a sequence; actorcore scores each token's "
                         "next token in its own sequence (verl's rolled input_ids) and supports no other labels")


def _gather_slices(local_1L: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The SP group's ``(1, L)`` slices (verl's, in rank order) -> the whole ``(1, sp * L)`` (ids: no autograd)."""
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.long, device=local_1L.device) for _ in range(ctx.sp_size)]
    dist.all_gather(sizes, torch.tensor([local_1L.shape[1]], device=local_1L.device), group=ctx.sp_group)
    if len({int(n) for n in sizes}) != 1:
        raise ValueError(f"the SP ranks pass slices of {[int(n) for n in sizes]} tokens; under Ulysses each rank "
                         "passes an equal slice of the padded batch (verl's ulysses_pad_and_slice_inputs)")
    parts = [torch.empty_like(local_1L) for _ in range(ctx.sp_size)]
    dist.all_gather(parts, local_1L.contiguous(), group=ctx.sp_group)
    return torch.cat(parts, dim=1)


def _my_slice(full_T: torch.Tensor, ctx: Any) -> torch.Tensor:
    """This rank's contiguous slice of a full per-token output (the slice verl's gather expects from it)."""
    if ctx is None:
        return full_T
    n = full_T.shape[0] // ctx.sp_size
    return full_T[ctx.sp_rank * n:(ctx.sp_rank + 1) * n]


def _install_forward(handle: PatchHandle, model: torch.nn.Module, ctx: Any, kind: str, padded: bool) -> None:
    had_own = "forward" in model.__dict__
    previous = model.__dict__.get("forward")

    def restore() -> None:
        if had_own:
            model.__dict__["forward"] = previous
        else:
            model.__dict__.pop("forward", None)

    handle.add_undo(restore)
    model.__dict__["forward"] = VerlForward(model, ctx, kind, padded)


def _packed_logits(model: torch.nn.Module, batch: PackedBatch, ctx: Any) -> torch.Tensor:
    """``[1, T, V]`` logits from the packed decoder (this rank's slice under SP), a fresh tensor.

    Made by the LM head directly in the output's shape (no view of another tensor): verl divides it in place
    by the temperature, and an in-place change through a view would drop the backward hooks FSDP registered
    on the returned tensor.
    """
    from actorcore.hf.decoder import decoder_call, run_decoder
    from actorcore.hf.head import head_params

    call = decoder_call(model, batch, ctx)
    hidden_TD = run_decoder(call)  # this rank's slice under SP (verl pre-padded it)
    logits_1TV = model.get_output_embeddings()(hidden_TD.unsqueeze(0))
    return head_params(model, call.spec).apply(logits_1TV)
