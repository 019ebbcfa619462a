"""Build a Megatron-Core model from an HF config: an ``McoreModel`` holding this rank's ``GPTModel`` chunks (one
per pipeline stage, several with virtual stages) and the facts of its HF side (``mcore/handle.py``).

Layers come from Megatron's local spec with the core attention swapped for ``PackedCoreAttention`` (or
TransformerEngine's when TE is installed), so packed THD batches run everywhere, and the local torch norm
swapped for ``SequenceParallelTorchNorm``, so sequence parallelism (needed to train MoE at TP > 1) runs
too. The model returns the final hidden states instead of logits: log-probs are computed by the fused
vocabulary-parallel kernel from the output-layer weight, and a critic (``value_head=True``) has a
replicated ``value_head`` [1, D] instead of an output layer. With ``mtp=True`` the last stage also holds the
multi-token-prediction layers (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5); the forward then returns their hidden states
after the main ones.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import types
from dataclasses import dataclass
from typing import Any

import torch

from actorcore._moved import renamed
from actorcore.archs import check_config, get_spec, registered_model_types, text_config
from actorcore.archs.spec import UnsupportedArchitectureError
from actorcore.errors import UnsupportedConfigError
from actorcore.mcore._megatron import require_megatron
from actorcore.mcore.cpu_runtime import te_absent_fixes
from actorcore.mcore.build.config import gpt_model_args, hf_to_mcore_config, uses_interleaved_mrope
from actorcore.mcore.build.ep_overlap import check_ep_overlap
from actorcore.mcore.build.expert_grads import mark_experts_expert_data_parallel
from actorcore.mcore.handle import EXPERT_LAYOUTS, GROUPED, PER_EXPERT, McoreModel
from actorcore.mcore.build.layout_check import check_layout
from actorcore.mcore.build.mla import route_kv_down_projection_full_width
from actorcore.mcore.build.norm import with_sequence_parallel_norms
from actorcore.mcore.parallel import McoreParallel, context_from_megatron
from actorcore.mcore.build.recompute import RecomputePlan, check_recompute, check_recompute_config
from actorcore.mcore.build.vlm import add_vision_tower, check_vlm_build, is_vlm_config, language_config

logger = logging.getLogger(__name__)


def megatron_model_types() -> list[str]:
    """Registered architectures the Megatron route runs: those whose spec has Megatron rules (the one list)."""
    return [m for m in registered_model_types() if not get_spec(m).mcore.refused]


def refused_megatron_model_types() -> dict[str, str]:
    """Registered architectures whose spec refuses the Megatron route, with the reason it states."""
    return {m: get_spec(m).mcore.refused for m in registered_model_types()
            if get_spec(m).mcore.refused}


def mcore_spec_for(hf_config: Any):
    """The arch's Megatron part, or a clear error saying why there is none. The config passes the HF route's checks
    (``archs.check_config``: unsupported fields, logit transforms the spec does not declare), and the Megatron
    route's head applies no logit transform: a config whose declared one is active is refused."""
    spec = get_spec(hf_config.model_type)
    if spec.mcore.refused:
        reason = spec.mcore.refused
        raise UnsupportedArchitectureError(f"{spec.model_type} is not supported on the Megatron-Core route: {reason}")
    check_config(spec, hf_config)
    text = text_config(hf_config)
    for transform in spec.head:
        value = getattr(text, transform.field, None)
        if not transform.is_neutral(value):
            raise UnsupportedArchitectureError(
                f"{spec.model_type}: config.{transform.field}={value!r} changes the logits in the model's own forward "
                f"({transform.op}), which the Megatron route's head does not apply; use the Hugging Face route")
    return spec.mcore


def _core_attention_module() -> type:
    if importlib.util.find_spec("transformer_engine") is not None:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    from actorcore.mcore.build.attention import PackedCoreAttention

    return PackedCoreAttention


def _with_core_attention(layer_spec: Any, core_attention: type) -> Any:
    attention = layer_spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=core_attention)
    attention = dataclasses.replace(attention, submodules=submodules)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules,
                                                                          self_attention=attention))


class _ReturnHidden(torch.nn.Module):
    """Stands in for the output layer of a critic: GPTModel then returns the final hidden states."""

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        return hidden_states, None


def _return_hidden(hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
    return hidden_states, None


def _mtp_block_spec(config: Any, mtp: Any, core_attention: type, vp_stage: int | None, moe_experts: str | None
                    ) -> Any:
    """Megatron's MTP block spec: each MTP layer's decoder layer is the full-attention spec of the main decoder layer
    ``mtp.decoder_layer_like`` (the last when None; its dense or MoE MLP, its experts ``moe_experts``' kernel) with
    the packed core attention, and every norm the sequence-parallel-capable torch norm (Megatron picks its fused or
    wrapped one)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    from actorcore.mcore.build.gather_dispatch import with_grouped_experts
    from actorcore.mcore.build.norm import SequenceParallelTorchNorm

    layers = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")
    like = config.num_layers - 1 if mtp.decoder_layer_like is None else mtp.decoder_layer_like
    layer = with_sequence_parallel_norms(_with_core_attention(layers[like], core_attention))
    layer = with_grouped_experts(layer, moe_experts, fused=False)
    spec = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False, vp_stage=vp_stage)
    if spec is None:
        return None
    norms = dict(enorm=SequenceParallelTorchNorm, hnorm=SequenceParallelTorchNorm,
                 layer_norm=SequenceParallelTorchNorm)
    layers = [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, **norms)) for s in spec.layer_specs]
    return dataclasses.replace(spec, layer_specs=layers)


def _postprocess(self: Any, hidden_states: Any, input_ids: Any, position_ids: Any, labels: Any, rotary_pos_emb: Any,
                 rotary_pos_cos: Any, rotary_pos_sin: Any, mtp_in_postprocess: Any = None, loss_mask: Any = None,
                 decoder_input: Any = None, attention_mask: Any = None, inference_params: Any = None,
                 packed_seq_params: Any = None, sequence_len_offset: Any = None, runtime_gather_output: Any = None,
                 extra_block_kwargs: Any = None, inference_context: Any = None) -> Any:
    """GPTModel's post-processing for a model with MTP layers (set per instance): runs Megatron's MTP block
    when the call asks for it (``run_mtp`` of the batch's ``BatchParams``, which ``compute_logprobs(...,
    mtp_loss_scale=...)`` sets for its micro-batches) and returns the hidden states ``[B, (1 + mtp) * S, D]``
    (main first).
    Megatron's own version needs labels and turns the MTP outputs into a loss with its cross entropy and a
    one-token roll per depth; actorcore scores them with the fused vocabulary-parallel kernel instead."""
    if mtp_in_postprocess and getattr(packed_seq_params, "run_mtp", False):
        hidden_states = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                                 attention_mask=attention_mask, inference_params=inference_params,
                                 rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                 rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                                 sequence_len_offset=sequence_len_offset, embedding=self.embedding,
                                 **(extra_block_kwargs or {}))
    if not self.post_process:
        return hidden_states
    return hidden_states.transpose(0, 1).contiguous()


def mtp_layer_count(hf_config: Any, mtp: bool) -> int | None:
    """``mtp_num_layers`` for a model built with (``mtp=True``) or without MTP layers; refuses what cannot have them."""
    if not mtp:
        return None
    rules = mcore_spec_for(hf_config).mtp
    if rules is None:
        raise UnsupportedArchitectureError(f"{hf_config.model_type} has no multi-token-prediction rules on the "
                                           "Megatron route: drop mtp=True (--mtp)")
    field, count = rules.count_field(hf_config)
    if count < 1:
        raise ValueError(f"mtp=True (--mtp) needs {field} >= 1 in the {hf_config.model_type} config (it is "
                         f"{count}): the checkpoint has no MTP layers to build")
    refusal = rules.refusal(hf_config)
    if refusal is not None:
        raise UnsupportedConfigError(f"{hf_config.model_type}: multi-token prediction with {refusal}")
    return count


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The dtype an HF config declares (``dtype`` / ``torch_dtype``), float32 when it declares none."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, value) if isinstance(value, str) else value


def build_gpt_model(hf_config: Any, parallel: McoreParallel | None = None, dtype: torch.dtype | None = None, *,
                    value_head: bool = False, vocab_multiple: int = 128, mtp: bool = False,
                    expert_layout: str | None = None, moe_experts: str = "auto", compiled_layers: bool | str = "auto",
                    swiglu_mlp: str | bool = "auto", recompute: str | None = None,
                    memory_budget_gib: float | None = None,
                    **config_overrides: Any) -> McoreModel:
    """This rank's model (``McoreModel``: its chunks, ``len == vp or 1``, and their HF side), after
    ``initialize_megatron`` with the same ``parallel`` layout.

    Each chunk is a ``GPTModel`` whose forward returns hidden states ``[B, S, D]`` on the last stage
    (``[B, S / tp, D]``, this rank's slice of the tokens, under sequence parallelism). Sequence parallelism
    is on by default for MoE models at tp > 1 (megatron-core trains MoE under TP only with it);
    ``sequence_parallel=True`` / ``False`` in ``config_overrides`` chooses it for any model at tp > 1.
    ``dtype`` defaults to the checkpoint's (``checkpoint_dtype``), which keeps conversion bit-exact.
    ``mtp=True`` builds the config's multi-token-prediction layers (``num_nextn_predict_layers``; Qwen3.5's
    ``mtp_num_hidden_layers``) on the last stage; by default they are left out (a checkpoint's MTP tensors are then
    dropped on load).
    ``overlap_moe_expert_parallel_comm=True`` (a config override): forward-backward under Megatron's combined 1F1B
    schedule, the expert-parallel all-to-alls overlapped with compute on CUDA (``mcore/build/ep_overlap.py`` says what
    it needs and refuses).
    ``expert_layout``: how the checkpoint to load stores a MoE model's experts (``"per_expert"``, or ``"grouped"``
    for transformers 5's stacked ``experts.gate_up_proj``; ``checkpoint_expert_layout(hf_dir, config)`` reads it);
    the export writes the same layout. ``None``: the architecture's only layout where it has one (gpt-oss,
    Qwen3-VL-MoE: grouped), else ``"per_expert"``. A vision-language config builds its language model with the HF vision
    tower in front of it (``mcore/build/vlm.py``).

    Speed, each exact and each with a way off (the handle carries the resolved choices):
    ``moe_experts``: the routed experts' kernel (``mcore/build/grouped_experts.py``): ``"auto"`` (quack's gated GEMMs where
    quack runs, else torch's ``grouped_mm``), ``"grouped"``, ``"quack"``, or ``"sequential"`` (megatron-core's
    ``SequentialMLP``); the same parameters, state dict and conversion either way.
    ``compiled_layers``: the layers' norms, residual adds and activations compiled (``mcore/build/layer.py``):
    ``"auto"`` on CUDA with 16-bit weights, ``True``, ``False``.
    ``swiglu_mlp``: the dense MLPs of compiled layers as quack's gated GEMMs (``mcore/build/layer.py``): ``"auto"``
    (where quack runs and covers them: SwiGLU, no biases, one TP rank), ``"quack"``, ``False``.
    ``recompute`` / ``memory_budget_gib``: activation recompute per layer and call (``mcore/build/recompute.py``):
    ``None`` (none), ``"full"``, ``"selective"``, or ``"auto"`` within ``memory_budget_gib``.
    ``fused_layers=``: the old name of ``compiled_layers`` (kept for one release, with a DeprecationWarning).
    """
    if "fused_layers" in config_overrides:
        renamed("build_gpt_model(fused_layers=...)", "compiled_layers=...")
        compiled_layers = config_overrides.pop("fused_layers")
    require_megatron()
    parallel = parallel or McoreParallel()
    dtype = dtype or checkpoint_dtype(hf_config)
    vlm_config = hf_config if is_vlm_config(hf_config) else None
    if vlm_config is not None:
        check_vlm_build(vlm_config, parallel, value_head=value_head)
        hf_config = language_config(vlm_config)
    spec = mcore_spec_for(hf_config)
    check_layout(hf_config, parallel)  # what megatron-core would assert on, deep in the build, on every rank
    if expert_layout is None:
        expert_layout = GROUPED if spec.uses_grouped_experts else PER_EXPERT
    _check_expert_layout(hf_config, spec, expert_layout)
    check_ep_overlap(hf_config, parallel, dtype, mtp=mtp, vlm=vlm_config is not None, config_overrides=config_overrides)
    recompute_plan = check_recompute(recompute, memory_budget_gib)
    context = context_from_megatron()  # refusals above need no parallel state
    parallel.check_context(context)
    options = LayerOptions(moe_experts, compiled_layers, recompute_plan, swiglu_mlp)
    chunks, options = _build_chunks(hf_config, parallel, dtype, value_head=value_head, vocab_multiple=vocab_multiple,
                                    mtp=mtp, options=options, config_overrides=config_overrides)
    if vlm_config is not None:
        add_vision_tower(chunks, vlm_config, dtype)
    # MLA under TP + SP: the RoPE key's gradient summed over all ranks' heads (see mcore/build/mla.py).
    patched = sum(route_kv_down_projection_full_width(chunk) for chunk in chunks)
    # EP = 1 at TP > 1: experts reduced over the expert data parallel group (see mcore/build/expert_grads.py).
    for chunk in chunks:
        mark_experts_expert_data_parallel(chunk)
    return McoreModel(chunks=chunks, hf_config=hf_config, spec=spec, parallel=parallel, context=context,
                      vocab_multiple=vocab_multiple, value_head=value_head, vlm_config=vlm_config,
                      expert_layout=expert_layout, mla_full_width_projections=patched, moe_experts=options.moe_experts,
                      compiled_layers=options.compiled_layers, recompute=options.recompute,
                      swiglu_mlp=options.swiglu_mlp)


def _fix_expert_output_biases(chunk: Any) -> None:
    """Two megatron-core 0.16.1 faults of expert output projections with biases (gpt-oss) at expert-TP size 1,
    mended on Megatron's own flags of those layers:

    - at EP = 1, ``RowParallelLinear`` "all-reduces" over the one-rank expert-TP group, which hands back its input
      as is, and the expert MLP adds the probability-weighted bias to it in place, which autograd refuses. Over one
      rank the reduction is the identity: the layer takes Megatron's explicit-communication path (no reduction), as
      it does at EP > 1;
    - under sequence parallelism the bias is marked ``sequence_parallel``, so ``finalize_model_grads`` sums its
      gradient over the TP group, adding up other experts' biases (each expert's whole gradient is on its own
      rank): the mark is taken off."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    for module in chunk.modules():
        if isinstance(module, RowParallelLinear) and module.is_expert and module.bias is not None \
                and module.tp_group.size() == 1 and module.skip_bias_add:
            module.explicit_expert_comm = True
            module.bias.sequence_parallel = False


def _drop_unused_output_weight(chunk: Any) -> None:
    """Tied embeddings with MTP on a last stage that is not the first (PP > 1): Megatron's shared weight there is the
    MTP stage's embedding replica (``shared_embedding_or_output_weight``), yet megatron-core 0.16.1 still allocates
    an output-layer weight beside it (only the first stage skips it), which nothing reads and which its own
    ``sharded_state_dict`` then refuses (it asserts the MTP stage has no ``output_layer.weight``). The unused weight
    is taken off, as the first stage's never exists."""
    if chunk.share_embeddings_and_output_weights and chunk.mtp_process and not chunk.pre_process \
            and chunk.output_layer.weight is not None:
        chunk.output_layer.weight = None


def _check_expert_layout(hf_config: Any, spec: Any, expert_layout: str) -> None:
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if expert_layout == PER_EXPERT and spec.uses_grouped_experts:
        raise ValueError(f"expert_layout='per_expert': {hf_config.model_type} checkpoints store the experts grouped "
                         "(experts.gate_up_proj / experts.down_proj) only: use expert_layout='grouped' (the default)")
    if expert_layout == GROUPED and not (spec.grouped_expert_rules or spec.uses_grouped_experts):
        raise ValueError(f"expert_layout='grouped': {hf_config.model_type} declares no grouped expert rules (a "
                         "dense model, or a MoE whose checkpoints store one tensor per expert): use 'per_expert'")


def _with_linear_attention(block: Any, config: Any, hf_config: Any, vp_stage: int | None) -> Any:
    """Hybrid models: actorcore's packed Gated DeltaNet as the mixer of the layers ``linear_attention_freq`` marks."""
    pattern = config.linear_attention_freq
    if not isinstance(pattern, list) or not any(pattern):
        return block
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from actorcore.mcore.build.linear_attention import with_linear_attention_layers

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return with_linear_attention_layers(block, pattern, offset, get_spec(hf_config.model_type).linear_attention.projections)


@dataclass(frozen=True)
class LayerOptions:
    """The layers' speed options of ``build_gpt_model``: as asked, then as resolved for the built config."""

    moe_experts: Any
    compiled_layers: Any
    recompute: RecomputePlan | None
    swiglu_mlp: Any = "auto"

    def resolved(self, config: Any, dtype: torch.dtype) -> "LayerOptions":
        """Refuses what the config cannot run; ``"auto"`` becomes a choice."""
        from actorcore.mcore.build.grouped_experts import resolve_moe_experts
        from actorcore.mcore.build.layer import resolve_compiled_layers, resolve_swiglu_mlp

        check_recompute_config(self.recompute, config)
        overlap = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
        fused = self.compiled_layers
        if overlap and (fused is True or self.recompute is not None):
            raise ValueError("overlap_moe_expert_parallel_comm=True runs the layers through Megatron's schedule plan, "
                             "which bypasses the compiled layers' and recompute's forward: pass "
                             "compiled_layers=False and recompute=None with it")
        fused = False if overlap and fused == "auto" else resolve_compiled_layers(fused, config, dtype)
        return LayerOptions(resolve_moe_experts(self.moe_experts, config, dtype), fused, self.recompute,
                            resolve_swiglu_mlp(self.swiglu_mlp, config, dtype, fused))


def _with_layer_options(layer_spec: Any, options: LayerOptions) -> Any:
    """A decoder layer spec with the resolved experts kernel and actorcore's planned (and maybe fused) layer."""
    from actorcore.mcore.build.gather_dispatch import with_grouped_experts
    from actorcore.mcore.build.layer import with_planned_layers

    layer_spec = with_grouped_experts(layer_spec, options.moe_experts, options.compiled_layers)
    return with_planned_layers(layer_spec, options.compiled_layers, options.swiglu_mlp)


def _build_chunks(hf_config: Any, parallel: McoreParallel, dtype: torch.dtype, *, value_head: bool,
                  vocab_multiple: int, mtp: bool, options: LayerOptions,
                  config_overrides: dict[str, Any]) -> tuple[list[Any], LayerOptions]:
    """The ``GPTModel`` of every (virtual) pipeline stage of this rank, with our per-instance changes, and the
    layer options resolved for its config."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from actorcore.mcore.build.grouped_experts import pack_expert_parameters

    if "mtp_num_layers" in config_overrides:
        raise ValueError("pass mtp=True (not mtp_num_layers) to build the multi-token-prediction layers")
    if mtp and value_head:
        raise ValueError("a critic (value_head=True) has no output head for multi-token prediction: drop mtp=True")
    # Multi-token-prediction layers: only on request (HF models have none; the log-probs never need them).
    config_overrides = {**config_overrides, "mtp_num_layers": mtp_layer_count(hf_config, mtp)}
    config = hf_to_mcore_config(hf_config, parallel, dtype, **config_overrides)
    options = options.resolved(config, dtype)
    model_args = gpt_model_args(hf_config, vocab_multiple)
    if model_args["vocab_size"] % parallel.tp:
        raise ValueError(f"padded vocabulary {model_args['vocab_size']} does not split over tp={parallel.tp}")
    if value_head:
        model_args["share_embeddings_and_output_weights"] = False
    core_attention = _core_attention_module()
    chunks = []
    for vp_stage in range(parallel.vp or 1):
        stage = vp_stage if parallel.vp else None
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                           vp_stage=stage)
        block = dataclasses.replace(block, layer_specs=[_with_core_attention(s, core_attention)
                                                        for s in block.layer_specs])
        block = _with_linear_attention(block, config, hf_config, stage)
        block = with_sequence_parallel_norms(block)
        block = dataclasses.replace(block, layer_specs=[_with_layer_options(s, options) for s in block.layer_specs])
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        mtp_spec = (_mtp_block_spec(config, mcore_spec_for(hf_config).mtp, core_attention, stage,
                                    options.moe_experts) if config.mtp_num_layers else None)
        with te_absent_fixes():
            model = GPTModel(config, block, pre_process=pre, post_process=post, vp_stage=stage,
                             mtp_block_spec=mtp_spec, **model_args)
        if model.mtp_process:
            model._postprocess = types.MethodType(_postprocess, model)
        if uses_interleaved_mrope(hf_config):
            from actorcore.mcore.build.rotary import use_interleaved_mrope

            use_interleaved_mrope(model)
        _fix_expert_output_biases(model)
        if post:
            if value_head:
                model.output_layer = _ReturnHidden()
                model.value_head = torch.nn.Linear(config.hidden_size, 1, dtype=dtype)
            else:
                # Per-instance: the fused kernel consumes hidden states and the output weight directly.
                model.output_layer.forward = _return_hidden
                _drop_unused_output_weight(model)
        # Megatron's local norms are created in float32; every parameter takes the model dtype (as Float16Module does).
        model = model.to(device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu", dtype=dtype)
        _restore_fp32_tensors(model, mcore_spec_for(hf_config))
        pack_expert_parameters(model)  # the grouped experts read their weights in place (final device and dtype)
        chunks.append(model)
    return chunks, options


def _restore_fp32_tensors(model: Any, spec: Any) -> None:
    """Back to float32 what Megatron keeps in float32 whatever the model dtype (``WeightRule.keeps_fp32``: the
    router's expert bias, which its router re-casts before each forward and checkpoint): loaded before that, a
    float32 checkpoint tensor would be rounded to the model dtype."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype != torch.float32 and spec.keeps_fp32_mcore(name):
            tensor.data = tensor.data.float()
