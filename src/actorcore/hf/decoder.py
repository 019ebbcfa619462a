"""One packed decoder pass of a Hugging Face model, and running code as a module's forward.

Legend: ``T`` packed tokens (this rank's shard under SP), ``D`` hidden.

The decoder runs with packed attention (no padding, nothing across sequences): the attention modules are
switched to actorcore's implementation for the call, and the packing metadata (``cu_seq_lens_q/k``,
``max_length_q/k``), the call's ``ParallelContext`` and its trace travel as explicit keyword arguments down to
the attention function. Under Ulysses sequence parallelism each rank runs its contiguous shard of the padded
batch. A hybrid model's linear-attention (Gated DeltaNet) modules get actorcore's packed forward for the call
as well (``hf.linear_attention``). A model patched with ``offload_activations`` runs its training calls with
the checkpointed layers' inputs offloaded (``hf.offload``). The trace proves, per call, that our attention ran
in every attention layer, our linear attention in every linear-attention layer, and the offload in every layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, Callable

import torch

from actorcore.archs import ArchSpec, submodule, text_config
from actorcore.batch import PackedBatch, pad_to_multiple, shard_for_sp
from actorcore.hf.attention import (
    PACKED_ATTENTION,
    PARALLEL_KWARG,
    TRACE_KWARG,
    PackingNotAppliedError,
    ParallelRef,
    TraceRef,
    attention_configs,
    attention_implementation,
    current_implementations,
    packed_attention,
    register_attention,
    switched_for_call,
    trace_key,
)
from actorcore.hf.batch_invariant import LINEAR_TRACE_KEY, batch_invariant_decoder, check_ran
from actorcore.hf.linear_attention import LINEAR_TRACE_KEYS, is_installed, packed_linear_attention, split_layers
from actorcore.hf.offload import OFFLOAD_KEPT, OFFLOAD_LAYERS, OFFLOAD_TENSORS, offloaded_layers
from actorcore.hf.patch import PatchNotAppliedError, patch_state, require_sequence_parallel_patch
from actorcore.hf.ulysses_attention import ULYSSES_ATTENTION
from actorcore.kernels.trace import check_trace
from actorcore.parallel import sp_size
from actorcore.errors import NonFiniteError  # noqa: F401 (re-exported)

ATTENTION_TRACE_KEYS = (trace_key(PACKED_ATTENTION), trace_key(ULYSSES_ATTENTION))


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None)


@contextlib.contextmanager
def finite_checks(embeddings: torch.nn.Module, layers: Any, enabled: bool) -> Any:
    """Forward hooks that raise ``NonFiniteError`` at the first module whose output is not finite."""
    if not enabled:
        yield
        return
    handles = []

    def hook(name: str) -> Callable:
        def check(module: Any, args: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                raise NonFiniteError(
                    f"{name} ({type(module).__name__}) produced non-finite values (NaN or inf): check that module's "
                    "weights and its inputs (learning rate, loss scale, a bad checkpoint)")
        return check

    try:
        handles.append(embeddings.register_forward_hook(hook("the input embedding")))
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(hook(f"decoder layer {i}")))
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_batch(model: Any, batch: PackedBatch) -> PackedBatch:
    """The batch on the model's device, its token ids checked against the vocabulary."""
    if not isinstance(batch, PackedBatch):
        raise ValueError(f"batch must be an actorcore.PackedBatch (use ac.pack / ac.pack_padded), got "
                         f"{type(batch).__name__}")
    embeddings = model.get_input_embeddings()
    if embeddings.weight.is_meta:
        raise ValueError(f"{type(model).__name__}'s weights are on the meta device (never loaded): load them "
                         "(from_pretrained, or to_empty(device=...) and load_state_dict) before computing")
    vocab = getattr(embeddings, "num_embeddings", None)
    if vocab is not None and not batch.input_ids.is_cuda:
        low, high = int(batch.input_ids.min()), int(batch.input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"token ids span [{low}, {high}] but the model's vocabulary has {vocab} entries")
    device = embeddings.weight.device
    return batch if batch.device == device else batch.to(device)


def _decoder_inputs(batch: PackedBatch, parallel: Any) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
    """The (padded) batch the decoder sees and this rank's input ids / position ids."""
    sp = sp_size(parallel)
    if sp == 1:
        return batch, batch.input_ids, batch.position_ids
    work = pad_to_multiple(batch, sp)
    rank = int(parallel.sp_rank)
    return work, shard_for_sp(work.input_ids, rank, sp), shard_for_sp(work.position_ids, rank, sp)


def _attention_switch(model: Any, decoder: Any, configs: list[Any], linear_modules: list[Any], spec: ArchSpec,
                      parallel: Any) -> Any:
    if sp_size(parallel) > 1:
        require_sequence_parallel_patch(model, parallel)
        return contextlib.nullcontext()
    # An actorcore attention / linear attention may be in place already (a patched model).
    attention_in_place = all(name and name.startswith("actorcore_") for name in current_implementations(configs))
    if all(is_installed(m) for m in linear_modules):
        return contextlib.nullcontext() if attention_in_place else packed_attention(decoder, configs,
                                                                                   register_attention())
    name = None if attention_in_place else register_attention()
    return switched_for_call(decoder, functools.partial(_hybrid_switch, configs, name, linear_modules,
                                                        spec.linear_attention))


@contextlib.contextmanager
def _hybrid_switch(configs: list[Any], name: str | None, linear_modules: list[Any], linear_spec: Any) -> Any:
    """Packed attention (unless ``name`` is None) and packed linear attention, for one forward."""
    with contextlib.ExitStack() as stack:
        if name is not None:
            stack.enter_context(attention_implementation(configs, name))
        stack.enter_context(packed_linear_attention(linear_modules, linear_spec))
        yield


def run_decoder(model: Any, spec: ArchSpec, batch: PackedBatch, parallel: Any = None,
                trace: Counter | None = None, check_finite: bool = False,
                batch_invariant: bool = False) -> tuple[torch.Tensor, PackedBatch]:
    """Packed decoder pass; returns this rank's final hidden states ``[T, D]`` and the batch as run.

    Raises ``PackingNotAppliedError`` if actorcore's attention did not run in every layer, and (with
    ``check_finite``) ``NonFiniteError`` at the first layer whose output holds NaN or inf. ``batch_invariant``:
    each token's hidden states do not depend on the rest of the pack (``hf.batch_invariant``).
    """
    decoder = submodule(model, spec.decoder)
    layers = submodule(decoder, spec.layers)
    _check_layer_count(model, layers)
    attention_layers, linear_modules = split_layers(text_config(model.config), layers, spec)
    configs = attention_configs(attention_layers, spec.attention)
    work, input_ids, position_ids = _decoder_inputs(batch, parallel)
    switch = _attention_switch(model, decoder, configs, linear_modules, spec, parallel)
    trace = Counter() if check_trace(trace) is None else trace
    invariant = batch_invariant_decoder(decoder, spec, trace) if batch_invariant else contextlib.nullcontext()
    cu = work.cu_seqlens
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids.unsqueeze(1),
        use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=work.max_seqlen,
        max_length_k=work.max_seqlen, **{PARALLEL_KWARG: ParallelRef(parallel), TRACE_KWARG: TraceRef(trace)},
    )
    if spec.vision is not None:
        from actorcore.hf.vlm import vlm_decoder_inputs

        kwargs.update(vlm_decoder_inputs(model, spec, work, parallel))
    if "inputs_embeds" in kwargs:
        kwargs.pop("input_ids")
    before = sum(trace[k] for k in ATTENTION_TRACE_KEYS)
    before_linear = sum(trace[k] for k in LINEAR_TRACE_KEYS)
    offload = _offload_layers(model)
    before_offload = (trace[OFFLOAD_LAYERS], trace[OFFLOAD_KEPT], trace[OFFLOAD_TENSORS])
    before_invariant = trace[LINEAR_TRACE_KEY]
    # Offload wraps the layers' checkpoint functions first, so the attention switch (which wraps them too, for
    # the recomputation) runs inside it.
    offloading = (offloaded_layers(list(layers), trace, type(model).__name__, offload) if offload
                  else contextlib.nullcontext())
    with offloading, switch, invariant, finite_checks(model.get_input_embeddings(), layers, check_finite):
        out = decoder(**kwargs)
    if offload:
        _check_offload_ran(model, len(layers), offload, trace[OFFLOAD_LAYERS] - before_offload[0],
                           trace[OFFLOAD_KEPT] - before_offload[1], trace[OFFLOAD_TENSORS] - before_offload[2])
    if batch_invariant:
        check_ran(trace, before_invariant, len(layers))
    ran = sum(trace[k] for k in ATTENTION_TRACE_KEYS) - before
    if ran < len(attention_layers):
        raise PackingNotAppliedError(
            f"packed attention ran {ran} times for {len(attention_layers)} attention layers: the installed "
            "transformers bypassed actorcore's attention; refusing to return unpacked results"
        )
    ran = sum(trace[k] for k in LINEAR_TRACE_KEYS) - before_linear
    if ran < len(linear_modules):
        raise PackingNotAppliedError(
            f"packed linear attention ran {ran} times for {len(linear_modules)} linear-attention layers: the "
            "installed transformers bypassed actorcore's linear attention (its conv and delta-rule state would run "
            "across sequences); refusing to return unpacked results"
        )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if check_finite and not bool(torch.isfinite(hidden).all()):
        raise NonFiniteError("the decoder's final norm produced non-finite values (NaN or inf)")
    return hidden[0], work


def _check_layer_count(model: Any, layers: Any) -> None:
    """The model's forward runs ``config.num_hidden_layers`` layers: a count edited after the model was built
    would leave layers unrun (and the packed-attention check blaming transformers), so it is named here."""
    count = getattr(text_config(model.config), "num_hidden_layers", None)
    if isinstance(count, int) and count != len(layers):
        raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers but its config says "
                         f"num_hidden_layers={count}: the config was changed after the model was built; set it "
                         f"back to {len(layers)}, or build the model from the edited config")


def _offload_layers(model: Any) -> int:
    """Leading layers to offload in this call: only calls that record gradients (else nothing is checkpointed)."""
    state = patch_state(model)
    return state.offload_layers if state is not None and torch.is_grad_enabled() else 0


def _check_offload_ran(model: Any, layers: int, offload: int, ran: int, kept: int, tensors: int) -> None:
    if ran < offload or ran + kept < layers:
        raise PatchNotAppliedError(
            f"activation offload ran in {ran + kept} of {layers} decoder layers of {type(model).__name__} "
            f"({ran} of the {offload} to offload): their checkpoint "
            "did not run (transformers checkpoints only in training mode: call model.train(); "
            f"model.training={model.training}) or the installed transformers bypassed the layers' "
            "_gradient_checkpointing_func; refusing to continue without the offload that was asked for")
    if tensors < offload:
        raise PatchNotAppliedError(
            f"activation offload moved {tensors} tensors for {offload} offloaded layers: the installed torch "
            "checkpoint saved its inputs without the saved-tensor hooks in force; actorcore must be updated")


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
