"""Hugging Face config <-> Megatron-Core ``TransformerConfig`` (+ ``GPTModel`` arguments), as a field table.

``FIELDS`` holds the one-to-one fields (both directions). Compound facts that span several HF fields (RoPE
scaling, the dense/MoE layer pattern, router scoring, activation, sliding window, MLA) have one small
converter each, which names the HF fields it consumes. Every HF field that is neither in the table, nor
consumed by a converter, nor known to be irrelevant to the model's math is listed in a warning.
Anything that would change the math and has no exact Megatron counterpart raises
``UnsupportedConfigError`` (nothing is silently approximated, e.g. unknown RoPE scaling is never treated
as linear).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from actorcore.archs import get_spec, registered_model_types
from actorcore.mcore.parallel import McoreParallel
from actorcore.errors import UnsupportedConfigError  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)


def _same(x: Any) -> Any:
    return x


@dataclass(frozen=True)
class Field:
    """``hf`` (first present of ``hf_aliases`` too) <-> ``mcore``; ``model_arg``: a GPTModel argument."""

    hf: str
    mcore: str
    model_arg: bool = False
    hf_aliases: tuple[str, ...] = ()
    to_mcore: Callable[[Any], Any] = _same
    to_hf: Callable[[Any], Any] = _same

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,) + self.hf_aliases


FIELDS: tuple[Field, ...] = (
    Field("num_hidden_layers", "num_layers"),
    Field("hidden_size", "hidden_size"),
    Field("num_attention_heads", "num_attention_heads"),
    Field("intermediate_size", "ffn_hidden_size"),
    Field("rms_norm_eps", "layernorm_epsilon"),
    Field("attention_dropout", "attention_dropout", to_mcore=float),
    Field("initializer_range", "init_method_std"),
    Field("vocab_size", "vocab_size", model_arg=True),
    Field("max_position_embeddings", "max_sequence_length", model_arg=True),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", model_arg=True, to_mcore=bool),
    # MoE
    Field("num_experts", "num_moe_experts", hf_aliases=("num_local_experts", "n_routed_experts")),
    Field("num_experts_per_tok", "moe_router_topk"),
    Field("moe_intermediate_size", "moe_ffn_hidden_size"),
    Field("routed_scaling_factor", "moe_router_topk_scaling_factor", to_mcore=float),
    Field("n_group", "moe_router_num_groups"),
    Field("topk_group", "moe_router_group_topk"),
    # MLA
    Field("q_lora_rank", "q_lora_rank"),
    Field("kv_lora_rank", "kv_lora_rank"),
    Field("qk_nope_head_dim", "qk_head_dim"),
    Field("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    Field("v_head_dim", "v_head_dim"),
    # Gated DeltaNet (linear-attention) layers of hybrid models (mcore/build/linear_attention.py)
    Field("linear_conv_kernel_dim", "linear_conv_kernel_dim"),
    Field("linear_key_head_dim", "linear_key_head_dim"),
    Field("linear_value_head_dim", "linear_value_head_dim"),
    Field("linear_num_key_heads", "linear_num_key_heads"),
    Field("linear_num_value_heads", "linear_num_value_heads"),
)

# HF fields with no effect on the model's math (generation, bookkeeping, outputs).
IRRELEVANT = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_router_logits", "dtype", "torch_dtype",
    "transformers_version", "architectures", "model_type", "_name_or_path", "id2label", "label2id",
    "return_dict", "output_hidden_states", "output_attentions", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class", "num_labels", "_attn_implementation_autoset", "router_aux_loss_coef",
    "tie_encoder_decoder", "max_window_layers", "classifier_dropout",
    # How the checkpoint stores some weights (gpt-oss's MXFP4 experts): the reader dequantises them on load.
    "quantization_config",
})

_ACTIVATIONS = {"silu": "silu", "swish": "silu"}


def _get(hf: Any, name: str, default: Any = None) -> Any:
    return getattr(hf, name, default)


def _has(hf: Any, name: str) -> bool:
    """A field the config class really stores (not an ``attribute_map`` alias)."""
    return name in hf.to_dict()


def _rope_parameters(hf: Any) -> dict[str, Any]:
    params = _get(hf, "rope_parameters") or _get(hf, "rope_scaling") or {}
    params = dict(params)
    if "rope_theta" not in params and _get(hf, "rope_theta") is not None:
        params["rope_theta"] = _get(hf, "rope_theta")
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


# Megatron's llama3 RoPE scaling takes only the factor; the other three are fixed at these values.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _convert_rope(hf: Any, mla: bool, partial_rotary: bool = False,
                  text_mrope: bool = False) -> tuple[dict, dict]:
    """(TransformerConfig fields, GPTModel args) for RoPE; refuses what Megatron cannot reproduce.

    ``partial_rotary``: the arch rotates the first ``partial_rotary_factor`` of each head's dims with the
    non-interleaved layout (Megatron's ``rotary_percent``, the same frequencies). ``text_mrope``: a text model whose
    M-RoPE sections always see the same (text) position, i.e. plain RoPE."""
    p = _rope_parameters(hf)
    kind = p["rope_type"]
    theta = p.get("rope_theta", 10000.0)
    cfg: dict[str, Any] = {}
    model: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": theta}
    factor = float(p.get("partial_rotary_factor", _get(hf, "partial_rotary_factor", None) or 1.0) or 1.0)
    if factor != 1.0:
        # HF and Megatron both rotate the first int(head_dim * factor) dims of each head, in halves (rotate_half);
        # an architecture states in its spec that its HF model does so (``partial_rotary``): one that pairs the
        # dims interleaved must not be mapped here.
        if mla or not partial_rotary or not 0.0 < factor < 1.0:
            raise UnsupportedConfigError(f"partial_rotary_factor={factor} is not supported for {hf.model_type}"
                                         + (" with multi-head latent attention" if mla else ""))
        model["rotary_percent"] = factor
    if p.get("mrope_section") is not None and not text_mrope:
        model["position_embedding_type"] = "mrope"
        cfg["mrope_section"] = _convert_mrope(p, mla)
    if kind == "default":
        pass
    elif kind == "linear" and not mla:
        model["seq_len_interpolation_factor"] = float(p["factor"])
    elif kind == "llama3" and not mla:
        odd = {k: p.get(k) for k, v in _LLAMA3_FIXED.items() if float(p.get(k, v)) != v}
        if odd:
            raise UnsupportedConfigError(
                f"llama3 RoPE scaling with {odd}: Megatron-Core fixes these at {_LLAMA3_FIXED} (only the factor is "
                "configurable), so it would not reproduce this model"
            )
        model.update(rope_scaling=True, rope_scaling_factor=float(p["factor"]))
    elif kind == "yarn" and not mla:
        model["position_embedding_type"] = "yarn"
        cfg.update(_gpt_yarn(hf, p))
    elif kind == "yarn" and mla:
        cfg.update(rope_type="yarn", rotary_scaling_factor=float(p["factor"]),
                   original_max_position_embeddings=int(p["original_max_position_embeddings"]),
                   beta_fast=float(p.get("beta_fast", 32.0)), beta_slow=float(p.get("beta_slow", 1.0)),
                   mscale=float(p.get("mscale", 1.0)), mscale_all_dim=float(p.get("mscale_all_dim", 0.0)))
    else:
        raise UnsupportedConfigError(
            f"RoPE scaling type {kind!r} ({p}) has no exact Megatron-Core counterpart on this route "
            "(supported: default, linear, llama3 with Megatron's fixed frequencies, yarn)"
        )
    if mla:
        cfg["rotary_base"] = theta
        cfg.setdefault("rope_type", "rope")
    return cfg, model


# YaRN on a GPT (not MLA) model: megatron-core's GPTModel and attention read these attributes of the config, which
# ``TransformerConfig`` does not declare; ``hf_to_mcore_config`` sets them on the built config.
YARN_ATTRIBUTES = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                   "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


def _gpt_yarn(hf: Any, p: dict[str, Any]) -> dict[str, Any]:
    """Megatron's YaRN attributes for HF's yarn RoPE (``_compute_yarn_parameters``): the same inverse frequencies
    (``truncate`` rounds the correction range) and the same cos/sin factor (``0.1 ln(factor) + 1``, or the
    mscale ratio when both mscale and mscale_all_dim are set)."""
    if p.get("attention_factor") is not None:
        raise UnsupportedConfigError(f"yarn RoPE with an explicit attention_factor ({p['attention_factor']}): "
                                     "Megatron-Core derives it from factor / mscale / mscale_all_dim only")
    original = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    factor = _get(hf, "max_position_embeddings") / original if factor is None else factor
    both = bool(p.get("mscale")) and bool(p.get("mscale_all_dim"))
    return {"yarn_rotary_scaling_factor": float(factor), "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(p.get("beta_fast") or 32.0), "yarn_beta_slow": float(p.get("beta_slow") or 1.0),
            "yarn_mscale": float(p["mscale"]) if both else None,
            "yarn_mscale_all_dim": float(p["mscale_all_dim"]) if both else None,
            "yarn_correction_range_round_to_int": bool(p.get("truncate", True))}


def _convert_mrope(p: dict[str, Any], mla: bool) -> list[int]:
    """Multimodal RoPE: the (t, h, w) split of the rotary frequencies. Megatron-Core assigns them in contiguous
    sections like HF (Qwen2-VL / Qwen2.5-VL); the interleaved layout (Qwen3-VL, ``mrope_interleaved``) is
    actorcore's rotary module, which ``build_gpt_model`` puts in (``uses_interleaved_mrope``)."""
    if mla:
        raise UnsupportedConfigError(f"M-RoPE with {p}: Megatron-Core's multimodal RoPE does not run with MLA")
    return [int(x) for x in p["mrope_section"]]


def uses_interleaved_mrope(hf_config: Any) -> bool:
    """Whether the config's M-RoPE interleaves the (t, h, w) frequencies (Qwen3-VL): the model then takes
    ``actorcore.mcore.build.rotary``'s embedding in place of Megatron's contiguous one."""
    p = _rope_parameters(hf_config)
    return p.get("mrope_section") is not None and bool(p.get("mrope_interleaved"))


def _moe_layer_pattern(hf: Any, num_layers: int) -> list[int]:
    """1 for MoE layers, 0 for dense ones (Qwen: decoder_sparse_step + mlp_only_layers; DeepSeek: first_k_dense_replace)."""
    step = _get(hf, "decoder_sparse_step", 1) or 1
    dense = set(_get(hf, "mlp_only_layers", None) or [])
    first_dense = _get(hf, "first_k_dense_replace", 0) or 0
    moe_freq = _get(hf, "moe_layer_freq", 1) or 1
    return [0 if (i in dense or (i + 1) % step or i < first_dense or (i - first_dense) % moe_freq) else 1
            for i in range(num_layers)]


def _convert_moe(hf: Any, num_experts: int | None, aux_loss: bool, spec_overrides: dict) -> dict[str, Any]:
    if not num_experts:
        return {}
    cfg: dict[str, Any] = {
        "moe_layer_freq": _moe_layer_pattern(hf, _get(hf, "num_hidden_layers")),
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
    }
    # An architecture that always scores one way (no scoring_func field) states it in its spec's overrides.
    scoring = _get(hf, "scoring_func", None) or spec_overrides.get("moe_router_score_function", "softmax")
    if scoring == "softmax":
        # norm_topk_prob (absent on Mixtral, which always renormalises): top-k of the logits, softmax over
        # them == softmax, top-k, renormalise. Without it: softmax over all experts, then top-k.
        cfg["moe_router_pre_softmax"] = not _get(hf, "norm_topk_prob", True)
    elif scoring == "sigmoid":
        cfg["moe_router_score_function"] = "sigmoid"
        cfg["moe_router_enable_expert_bias"] = _get(hf, "topk_method", "noaux_tc") == "noaux_tc"
        if not _get(hf, "norm_topk_prob", True):
            raise UnsupportedConfigError("sigmoid router scoring without norm_topk_prob is not supported")
        if _get(hf, "num_experts_per_tok") == 1:
            raise UnsupportedConfigError("sigmoid router scoring with num_experts_per_tok=1: HF renormalises the "
                                         "single weight to 1, Megatron-Core keeps the sigmoid score")
        # RL default: the expert bias stays as loaded (Megatron would move it towards balance after each step).
        cfg["moe_router_bias_update_rate"] = 1e-3 if aux_loss else 0.0
    else:
        raise UnsupportedConfigError(f"router scoring_func={scoring!r} is not supported (softmax, sigmoid)")
    groups, group_topk = _get(hf, "n_group", None), _get(hf, "topk_group", None)
    if groups and groups > 1 and _get(hf, "num_experts_per_tok") // group_topk != 2:
        # HF ranks expert groups by their top-2 scores; Megatron by their top (top_k / group_topk).
        raise UnsupportedConfigError("grouped routing with num_experts_per_tok / topk_group != 2 ranks groups "
                                     "differently in Megatron-Core than in HF")
    if _get(hf, "router_jitter_noise", 0.0):
        raise UnsupportedConfigError(f"router_jitter_noise={_get(hf, 'router_jitter_noise')} (random routing "
                                     "noise) has no Megatron-Core counterpart")
    shared = _get(hf, "shared_expert_intermediate_size", 0) or 0
    if _get(hf, "n_shared_experts"):
        shared = _get(hf, "n_shared_experts") * _get(hf, "moe_intermediate_size")
    if shared:
        cfg["moe_shared_expert_intermediate_size"] = shared
    # RL default: no load-balancing loss (it would change the gradients); opt in with aux_loss=True.
    coeff = _get(hf, "router_aux_loss_coef", 0.0) if aux_loss else 0.0
    cfg["moe_aux_loss_coeff"] = coeff
    cfg["moe_router_load_balancing_type"] = "aux_loss" if coeff else "none"
    return cfg


def _convert_attention_extras(hf: Any, spec: Any, linear_attention: Any = None) -> dict[str, Any]:
    """``spec``: the arch's ``McoreSpec``; ``linear_attention``: its hybrid layers' facts (None: none)."""
    spec_overrides, spec_fields = spec.config_overrides, dict(spec.config_fields)
    cfg: dict[str, Any] = {}
    every_bias = spec_overrides.get("add_bias_linear", False)
    if _get(hf, "attention_bias", False) and not (spec_overrides.get("add_qkv_bias") or every_bias
                                                  or "attention_bias" in spec_fields):
        raise UnsupportedConfigError("attention_bias=True puts a bias on o_proj too; Megatron-Core can only add it "
                                     "together with biases on every MLP linear (add_bias_linear)")
    if every_bias and not _get(hf, "attention_bias", True):
        raise UnsupportedConfigError(f"{hf.model_type} with attention_bias=False: its MLP linears keep their biases, "
                                     "and Megatron-Core's add_bias_linear puts biases on q/k/v/o and the MLP together")
    if spec.attention_sinks:
        cfg["softmax_type"] = "learnable"
    if _has(hf, "qkv_bias"):
        cfg["add_qkv_bias"] = bool(_get(hf, "qkv_bias"))
    if _get(hf, "mlp_bias", False):
        raise UnsupportedConfigError("mlp_bias=True is not supported on the Megatron route")
    use_window = _get(hf, "use_sliding_window", True)
    window = _get(hf, "sliding_window", None)
    if use_window and window:
        # HF: query i sees keys j with i - window < j <= i; Megatron's window_size is (left, right).
        cfg["window_size"] = (int(window) - 1, 0)
    layer_types = _get(hf, "layer_types", None)
    if linear_attention is not None and linear_attention.layer_types_field != "layer_types":
        raise UnsupportedConfigError(f"{hf.model_type} names its linear-attention layers in "
                                     f"config.{linear_attention.layer_types_field}; the Megatron mapping reads and "
                                     "writes config.layer_types only")
    if layer_types and linear_attention is not None:
        kinds = set(layer_types) - {"full_attention", linear_attention.layer_type}
        if kinds:
            raise UnsupportedConfigError(f"layer types {sorted(kinds)} beside linear and full attention are not "
                                         "supported")
        cfg["linear_attention_freq"] = [int(t == linear_attention.layer_type) for t in layer_types]
        layer_types = None
    kinds = set(layer_types or ())
    if kinds - {"full_attention", "sliding_attention"} or ("sliding_attention" in kinds and "window_size" not in cfg):
        raise UnsupportedConfigError(f"per-layer attention types {sorted(kinds)} are not supported (full_attention, "
                                     "and sliding_attention with a sliding_window)")
    if "window_size" in cfg and "full_attention" in kinds:
        # Sliding and full layers mixed (gpt-oss alternates them): Megatron's per-layer pattern, 1 = sliding.
        cfg["window_attn_skip_freq"] = [int(t == "sliding_attention") for t in layer_types]
    if (_get(hf, "pretraining_tp", 1) or 1) != 1:
        raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
    return cfg


@dataclass(frozen=True)
class SigmoidGate:
    """``x * sigmoid(alpha * x)``: the gate of gpt-oss's clamped SwiGLU, as Megatron's ``activation_func`` (a
    value object, so configs built from equal HF configs compare equal and deep-copy)."""

    alpha: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x * self.alpha)


def _activation(hf: Any, spec: Any) -> dict[str, Any]:
    if spec.activation == "clamped_swiglu":
        # Megatron's unfused GLU: clamp gate above and up both ways at the value, act(gate) * (up + offset).
        return {"activation_func": SigmoidGate(float(_get(hf, "swiglu_alpha"))), "gated_linear_unit": True,
                "activation_func_clamp_value": float(_get(hf, "swiglu_limit")), "glu_linear_offset": 1.0,
                "bias_activation_fusion": False}
    act = _get(hf, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise UnsupportedConfigError(f"hidden_act={act!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
    return {"activation_func": torch.nn.functional.silu, "gated_linear_unit": True}


# Fields the compound converters read (so they are not reported as unknown).
CONSUMED = frozenset({
    "num_key_value_heads", "head_dim", "hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace", "moe_layer_freq",
    "scoring_func", "norm_topk_prob", "topk_method", "router_jitter_noise", "shared_expert_intermediate_size",
    "n_shared_experts", "attention_bias", "mlp_bias", "use_sliding_window", "sliding_window", "layer_types",
    "pretraining_tp", "qkv_bias", "num_nextn_predict_layers", "rope_interleave", "qk_head_dim", "swiglu_alpha",
    "swiglu_limit",
})


def _first_present(hf: Any, field: Field) -> tuple[str, Any] | None:
    for name in field.hf_names:
        value = _get(hf, name, None)
        if value is not None:
            return name, value
    return None


def warn_unknown_fields(hf: Any) -> list[str]:
    """HF fields this converter does not understand (logged as a warning)."""
    from transformers import PretrainedConfig

    mcore = get_spec(hf.model_type).mcore
    spec_fields = {name for name, _ in mcore.config_fields}
    if mcore.mtp is not None:  # read by build_gpt_model(..., mtp=True): the count, and what it refuses
        spec_fields |= set(mcore.mtp.count_fields) | {name for name, _ in mcore.mtp.refused_fields}
    known = set(IRRELEVANT) | set(CONSUMED) | spec_fields | {n for f in FIELDS for n in f.hf_names}
    base = set(PretrainedConfig().to_dict())
    unknown = sorted(k for k in hf.to_dict() if k not in known and k not in base)
    if unknown:
        logger.warning("%s: HF config fields not understood by the Megatron converter (ignored): %s",
                       hf.model_type, ", ".join(unknown))
    return unknown


def _declared_fields(hf: Any) -> set[str]:
    """The fields the config's class declares: an extra attribute given to a class without the field (say
    ``intermediate_size`` on Qwen3.5-MoE, whose every layer is MoE) is not read by its model."""
    try:
        return set(type(hf)().to_dict()) | set(getattr(type(hf), "attribute_map", {}))
    except (TypeError, ValueError):  # a config class that cannot be built with its defaults
        return set(hf.to_dict())


def _table_values(hf: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg: dict[str, Any] = {}
    model: dict[str, Any] = {}
    for field in FIELDS:
        found = _first_present(hf, field)
        if found is not None:
            (model if field.model_arg else cfg)[field.mcore] = field.to_mcore(found[1])
    return cfg, model


def mcore_fields(hf_config: Any, *, aux_loss: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TransformerConfig keyword arguments, GPTModel keyword arguments) for an HF config (no parallel sizes)."""
    spec = get_spec(hf_config.model_type)
    warn_unknown_fields(hf_config)
    cfg, model = _table_values(hf_config)
    if cfg.get("num_moe_experts") and "intermediate_size" not in _declared_fields(hf_config):
        cfg.pop("ffn_hidden_size", None)  # every layer MoE (Qwen3.5-MoE): no dense MLP reads it
    mla = cfg.get("kv_lora_rank") is not None
    heads = cfg["num_attention_heads"]
    cfg["num_query_groups"] = _get(hf_config, "num_key_value_heads", None) or heads
    if not mla:
        cfg["kv_channels"] = _get(hf_config, "head_dim", None) or cfg["hidden_size"] // heads
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            cfg.pop(name, None)
    else:
        cfg["multi_latent_attention"] = True
        if not _get(hf_config, "rope_interleave", True):
            raise UnsupportedConfigError("MLA with rope_interleave=False: Megatron-Core's MLA always "
                                         "de-interleaves the RoPE dims (as HF does with rope_interleave=True)")
    cfg.update(normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0)
    cfg.update(_activation(hf_config, spec.mcore))
    extras = _convert_attention_extras(hf_config, spec.mcore, spec.linear_attention)
    extras.update({mcore: bool(_get(hf_config, name, False)) for name, mcore in dict(spec.mcore.config_fields).items()})
    cfg.update(extras)
    rope_cfg, rope_model = _convert_rope(hf_config, mla, spec.mcore.partial_rotary, spec.mcore.text_mrope)
    cfg.update(rope_cfg)
    model.update(rope_model)
    cfg.update(_convert_moe(hf_config, cfg.get("num_moe_experts"), aux_loss, spec.mcore.config_overrides))
    mtp = _get(hf_config, "num_nextn_predict_layers", 0) or 0
    if mtp:
        cfg["mtp_num_layers"] = mtp
    cfg.update({k: v for k, v in spec.mcore.config_overrides.items() if k not in extras})
    return cfg, model


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Vocabulary rounded up so every tensor-parallel size dividing ``multiple`` splits it evenly."""
    return -(-vocab_size // multiple) * multiple


def hf_to_mcore_config(hf_config: Any, parallel: McoreParallel | None = None, dtype: torch.dtype = torch.float32,
                       *, aux_loss: bool = False, **overrides: Any):
    """The ``TransformerConfig`` (or ``MLATransformerConfig``) for an HF config at a parallel layout.

    ``overrides`` are TransformerConfig fields set last (e.g. ``recompute_granularity``). Sequence
    parallelism is on for MoE models at tp > 1 (megatron-core trains MoE under TP only with it) and off
    otherwise; ``sequence_parallel=`` overrides it.
    """
    from actorcore.mcore._megatron import require_megatron

    require_megatron()
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    parallel = parallel or McoreParallel()
    cfg, _ = mcore_fields(hf_config, aux_loss=aux_loss)
    cfg.update(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=1,
        context_parallel_size=parallel.cp,
        # megatron-core trains MoE layers under TP only with sequence parallelism; dense models opt in.
        sequence_parallel=parallel.tp > 1 and bool(cfg.get("num_moe_experts")),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    cfg.update(overrides)
    if parallel.cp > 1 and any(cfg.get("linear_attention_freq") or []):
        raise UnsupportedConfigError(
            f"{hf_config.model_type} has Gated DeltaNet (linear-attention) layers, which do not run under context "
            f"parallelism (cp={parallel.cp}): their causal conv and delta-rule state run across the CP chunks of a "
            "sequence; use cp=1 (Ulysses SP on the Hugging Face route splits them by heads instead)")
    if cfg.get("softmax_type", "vanilla") != "vanilla" and parallel.cp > 1:
        raise UnsupportedConfigError(f"{hf_config.model_type}: attention sinks (softmax_type={cfg['softmax_type']!r}) "
                                     "under context parallelism: actorcore's CP attention (all-gather and ring) has no "
                                     "sink term; run with cp=1")
    yarn = {name: cfg.pop(name) for name in YARN_ATTRIBUTES if name in cfg}
    cls = MLATransformerConfig if cfg.get("multi_latent_attention") else TransformerConfig
    config = cls(**cfg)
    for name, value in yarn.items():
        setattr(config, name, value)
    return config


def gpt_model_args(hf_config: Any, vocab_multiple: int = 128) -> dict[str, Any]:
    """``GPTModel`` keyword arguments (vocabulary padded to ``vocab_multiple``)."""
    _, model = mcore_fields(hf_config)
    model["vocab_size"] = padded_vocab_size(model["vocab_size"], vocab_multiple)
    return model


def mcore_to_hf_config(transformer_config: Any, model_args: dict[str, Any], model_type: str,
                       vocab_size: int) -> dict[str, Any]:
    """HF config fields back from a TransformerConfig + GPTModel args (the table, reversed).

    ``vocab_size`` is the unpadded HF vocabulary. Returns a dict for ``AutoConfig.for_model(model_type, **d)``.
    """
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    out: dict[str, Any] = {}
    for field in FIELDS:
        source = model_args if field.model_arg else dataclasses.asdict(transformer_config)
        if field.mcore in source and source[field.mcore] is not None:
            name = next((n for n in field.hf_names if _has(defaults, n)), None)
            if name is not None:
                out[name] = field.to_hf(source[field.mcore])
    out["vocab_size"] = vocab_size
    tc = transformer_config
    out["num_key_value_heads"] = tc.num_query_groups
    if not tc.multi_latent_attention:
        derived = tc.kv_channels * tc.num_attention_heads == tc.hidden_size
        if derived and getattr(defaults, "head_dim", None) is None:
            pass  # the config class derives it as hidden_size / num_attention_heads
        elif _has(defaults, "head_dim"):
            out["head_dim"] = tc.kv_channels
        else:
            raise UnsupportedConfigError(f"{model_type} configs have no head_dim field; kv_channels="
                                         f"{tc.kv_channels} != hidden_size / num_attention_heads")
    rope: dict[str, Any] = {"rope_theta": float(model_args.get("rotary_base", 10000.0)), "rope_type": "default"}
    if model_args.get("seq_len_interpolation_factor"):
        rope.update(rope_type="linear", factor=model_args["seq_len_interpolation_factor"])
    if model_args.get("rope_scaling"):
        rope.update(rope_type="llama3", factor=model_args["rope_scaling_factor"], **_LLAMA3_FIXED)
    if getattr(tc, "mrope_section", None):
        rope["mrope_section"] = list(tc.mrope_section)
    if model_args.get("rotary_percent", 1.0) != 1.0:
        rope["partial_rotary_factor"] = float(model_args["rotary_percent"])
    if getattr(tc, "yarn_rotary_scaling_factor", None) is not None:
        rope.update(rope_type="yarn", factor=tc.yarn_rotary_scaling_factor,
                    original_max_position_embeddings=tc.yarn_original_max_position_embeddings,
                    beta_fast=tc.yarn_beta_fast, beta_slow=tc.yarn_beta_slow,
                    truncate=tc.yarn_correction_range_round_to_int)
        if tc.yarn_mscale is not None:
            rope.update(mscale=tc.yarn_mscale, mscale_all_dim=tc.yarn_mscale_all_dim)
    out["rope_parameters"] = rope
    if isinstance(tc.linear_attention_freq, list):
        out["layer_types"] = ["linear_attention" if f else "full_attention" for f in tc.linear_attention_freq]
    # A VLM's language model (``qwen2_5_vl_text``) has no spec of its own, and no such fields.
    fields = get_spec(model_type).mcore.config_fields if model_type in registered_model_types() else ()
    for name, mcore in fields:
        out[name] = bool(getattr(tc, mcore))
    if _has(defaults, "num_nextn_predict_layers"):
        out["num_nextn_predict_layers"] = tc.mtp_num_layers or 0
    if tc.window_size is not None:
        out["sliding_window"] = tc.window_size[0] + 1
    if isinstance(tc.window_attn_skip_freq, list):
        out["layer_types"] = ["sliding_attention" if f else "full_attention" for f in tc.window_attn_skip_freq]
    if isinstance(tc.activation_func, SigmoidGate):
        out.update(swiglu_alpha=tc.activation_func.alpha, swiglu_limit=tc.activation_func_clamp_value)
    if tc.add_bias_linear and _has(defaults, "attention_bias"):
        out["attention_bias"] = True
    if tc.num_moe_experts:
        pattern = tc.moe_layer_freq if isinstance(tc.moe_layer_freq, list) else [1] * tc.num_layers
        if _has(defaults, "mlp_only_layers"):
            out.update(decoder_sparse_step=1, mlp_only_layers=[i for i, f in enumerate(pattern) if not f])
        elif _has(defaults, "first_k_dense_replace"):
            out["first_k_dense_replace"] = pattern.index(1) if 1 in pattern else tc.num_layers
        if _has(defaults, "norm_topk_prob") and tc.moe_router_score_function == "softmax":
            out["norm_topk_prob"] = not tc.moe_router_pre_softmax
        if tc.moe_shared_expert_intermediate_size and _has(defaults, "shared_expert_intermediate_size"):
            out["shared_expert_intermediate_size"] = tc.moe_shared_expert_intermediate_size
        if tc.moe_shared_expert_intermediate_size and _has(defaults, "n_shared_experts"):
            out["n_shared_experts"] = tc.moe_shared_expert_intermediate_size // tc.moe_ffn_hidden_size
    return out
