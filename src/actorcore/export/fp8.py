"""Blockwise FP8 (e4m3) weights in the layout of the DeepSeek-V3 and Qwen3 FP8 checkpoints.

A quantized ``[..., out, in]`` weight is stored as ``weight`` in ``torch.float8_e4m3fn`` plus ``weight_scale_inv``
in float32 ``[..., ceil(out/128), ceil(in/128)]``: per 128x128 block, ``scale_inv = amax / 448`` and
``weight = clamp(w / scale_inv, -448, 448)`` rounded to e4m3, so ``w ~= weight * scale_inv`` (edge blocks cover what is
left of a dimension; an all-zero block gets ``scale_inv = 1``). An e4m3 rollout engine reads this layout directly.

Which weights are quantized is data, the rule of transformers' FP8 loader (``replace_with_fp8_linear``), which is
what these checkpoints store: the weight of every ``nn.Linear`` and the expert projections of a fused-experts module
(a module named ``...experts``), except modules a skip list names. The default skip list is transformers' own
(``get_keys_to_not_convert``: the output embedding, tied weights) plus ``DEFAULT_MODULES_TO_NOT_CONVERT`` (router
gates that some models build as ``nn.Linear``). Embeddings, norms, biases and routers that are not ``nn.Linear``
are never quantized.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from actorcore.kernels.precision import autocast_disabled

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK_SIZE = (128, 128)
SCALE_SUFFIX = "_scale_inv"

# Module names (transformers' ``should_convert_module`` patterns: a prefix up to a module boundary, a regex, or a
# suffix) kept in high precision beyond transformers' defaults: MoE router and shared-expert gates built as
# ``nn.Linear`` (Qwen2/3-MoE-style ``shared_expert_gate``, Mixtral-style ``block_sparse_moe.gate``), which the FP8
# checkpoints keep in bf16. ``mlp.gate`` does not match ``mlp.gate_proj`` (module boundary).
DEFAULT_MODULES_TO_NOT_CONVERT = (r".*mlp\.gate", r".*shared_expert_gate", r".*block_sparse_moe\.gate", "lm_head")


@dataclass(frozen=True)
class BlockwiseFP8:
    """What ``hf_weight_stream(..., quantize=BlockwiseFP8(...))`` does (``quantize="fp8_blockwise"`` is the default
    one). ``modules_to_not_convert`` is added to the defaults (module names of the model, as in transformers'
    ``FineGrainedFP8Config``)."""

    block_size: tuple[int, int] = BLOCK_SIZE
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if len(self.block_size) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block_size):
            raise ValueError(f"block_size must be two positive ints, got {self.block_size!r}")

    def skip_patterns(self, model: torch.nn.Module) -> list[str]:
        """Every module-name pattern kept in high precision for ``model`` (a transformers model)."""
        return sorted({*_default_skips(model), *DEFAULT_MODULES_TO_NOT_CONVERT, *self.modules_to_not_convert})

    def hf_quantization_config(self, model: torch.nn.Module) -> dict:
        """The ``quantization_config`` for the exported ``config.json`` (transformers' ``FineGrainedFP8Config``
        fields, as the DeepSeek-V3 / Qwen3 FP8 checkpoints write them), listing by name the ``nn.Linear`` modules
        kept in high precision, so a loader (transformers, vLLM, SGLang) expects exactly the streamed layout."""
        skip = self.skip_patterns(model)
        kept = {p.replace(".base_layer", "") for p, m in model.named_modules()  # a LoRA layer: the plain name
                if _quantizable_module(p, m) and ".lora_" not in p and matches_module(p, skip)}
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block_size), "modules_to_not_convert": sorted(kept)}


def _default_skips(model: torch.nn.Module) -> list[str]:
    """transformers' default skip list (``get_keys_to_not_convert``): tied weights' modules, the output embedding
    and the module of the last parameter (the head); computed here too when that function is missing or moved."""
    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        return list(get_keys_to_not_convert(model))
    except (ImportError, AttributeError):  # another transformers layout, or not a PreTrainedModel
        pass
    skips = {name.rpartition(".")[0] for name, _ in list(model.named_parameters())[-1:]}
    output = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    skips |= {path for path, module in model.named_modules() if output is not None and module is output}
    return sorted(skips)


def matches_module(path: str, patterns: list[str]) -> bool:
    """Whether a module name matches a skip pattern as transformers' ``should_convert_module`` reads one: a prefix
    up to a module boundary (``layers.1`` matches ``layers.1.mlp``, not ``layers.11``), a regex with the same
    boundary (``.*mlp\\.gate`` matches ``layers.3.mlp.gate``, not ``mlp.gate_proj``), or a suffix."""
    return any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", path) or path.endswith(p) for p in patterns)


def _quantizable_module(path: str, module: torch.nn.Module) -> bool:
    """What transformers' FP8 loader replaces: an ``nn.Linear``, or a fused-experts module."""
    return isinstance(module, torch.nn.Linear) or path == "experts" or path.endswith(".experts")


QUANTIZE_SCHEMES = {"fp8_blockwise": BlockwiseFP8()}


def resolve_scheme(quantize: str | BlockwiseFP8 | None) -> BlockwiseFP8 | None:
    if quantize is None or isinstance(quantize, BlockwiseFP8):
        return quantize
    if quantize not in QUANTIZE_SCHEMES:
        raise ValueError(f"quantize must be None, one of {sorted(QUANTIZE_SCHEMES)} or a BlockwiseFP8, got "
                         f"{quantize!r}")
    return QUANTIZE_SCHEMES[quantize]


def quantized_model_names(model: torch.nn.Module, scheme: BlockwiseFP8, names: list[str]) -> set[str]:
    """The state-dict names (of ``model``'s own tree) whose tensors the scheme quantizes."""
    skip = scheme.skip_patterns(model)
    state = model.state_dict()
    modules = dict(model.named_modules())
    out = set()
    for name in names:
        path, _, attr = name.rpartition(".")
        module, tensor = modules.get(path), state[name]
        if module is None or not _quantizable_module(path, module) or not tensor.is_floating_point():
            continue
        linear_weight = isinstance(module, torch.nn.Linear) and attr == "weight" and tensor.dim() == 2
        expert_projection = not isinstance(module, torch.nn.Linear) and tensor.dim() >= 3  # not a bias
        if (linear_weight or expert_projection) and not matches_module(path, skip):
            out.add(name)
    return out


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``; a fused expert tensor ``x.gate_up_proj`` -> ``x.gate_up_proj_scale_inv``
    (transformers' names)."""
    return weight_name + SCALE_SUFFIX


def _scale_shape(shape: torch.Size, block_size: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], math.ceil(shape[-2] / block_size[0]), math.ceil(shape[-1] / block_size[1]))


def quantized_nbytes(shape: torch.Size, block_size: tuple[int, int] = BLOCK_SIZE) -> int:
    """Bytes of the FP8 weight plus its float32 scales."""
    return math.prod(shape) + 4 * math.prod(_scale_shape(shape, block_size))


def _quantize_2d(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    bm, bn = block_size
    sr, sc = math.ceil(rows / bm), math.ceil(cols / bn)
    padded = torch.nn.functional.pad(weight.float(), (0, sc * bn - cols, 0, sr * bm - rows)).contiguous()
    blocks = padded.view(sr, bm, sc, bn)
    amax = blocks.abs().amax(dim=(1, 3))  # [sr, sc]; zero padding never raises it
    # A tensor divisor, not a Python float: CUDA divides by a scalar as a multiplication by its reciprocal,
    # which is not the IEEE quotient (1/448 is inexact), so the scales would differ from the CPU's in the last bit.
    scale_inv = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX))  # inf, NaN stay
    q = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(sr * bm, sc * bn)[:rows, :cols].contiguous(), scale_inv


def quantize_fp8_blockwise(weight: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE, *,
                           name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of a ``[..., out, in]`` floating tensor (leading dims: experts), per
    ``block_size`` block of the last two dims. Non-finite values are refused (no scale represents them)."""
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: blockwise FP8 needs a floating tensor of at least 2 dims, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    flat = weight.reshape(-1, *weight.shape[-2:])
    with autocast_disabled(weight.device):  # autocast would change the bytes, and its stack refuses FP8 inputs
        parts = [_quantize_2d(w, block_size) for w in flat]  # one [out, in] at a time: fp32 temporaries stay small
        q = torch.stack([p[0] for p in parts]).reshape(weight.shape)
        s = torch.stack([p[1] for p in parts]).reshape(_scale_shape(weight.shape, block_size))
    if not torch.isfinite(s).all():  # amax propagates inf and NaN: checking the scales checks every element
        raise ValueError(f"{name} holds inf or NaN, which FP8 cannot scale: fix the weights (or export without "
                         "quantize)")
    return q, s


def dequantize_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                             block_size: tuple[int, int] = BLOCK_SIZE) -> torch.Tensor:
    """``weight * scale_inv`` per block (in float32, then cast to ``dtype``): the inverse of
    ``quantize_fp8_blockwise`` up to the e4m3 rounding."""
    if tuple(scale_inv.shape) != _scale_shape(weight.shape, block_size):
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, but a {tuple(weight.shape)} weight in "
                         f"{block_size} blocks needs {_scale_shape(weight.shape, block_size)}")
    rows, cols = weight.shape[-2:]
    with autocast_disabled(weight.device):
        scale = scale_inv.float().repeat_interleave(block_size[0], dim=-2)[..., :rows, :]
        scale = scale.repeat_interleave(block_size[1], dim=-1)[..., :cols]
        return (weight.float() * scale).to(dtype)
