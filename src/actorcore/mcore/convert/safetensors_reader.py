"""Reading an HF checkpoint directory: lazy, sliced access to its safetensors tensors (single file or sharded
index), so each rank reads only its slice of each tensor (``safe_open(...).get_slice``).

MXFP4 checkpoints (``config.json``'s ``quantization_config.quant_method == "mxfp4"``, the gpt-oss releases) store a
fused-experts weight ``X`` ``[E, in, out]`` as ``X_blocks`` ``[E, out, in / 32, 16]`` and ``X_scales``
``[E, out, in / 32]`` (``kernels/mxfp4.py``); the reader shows them as the one bf16 tensor ``X`` in the model's
layout, dequantised when read (only the experts asked for).

compressed-tensors' packed integer weights (``X.weight_packed`` int32 beside ``X.weight_scale`` / ``X.weight_shape``;
the Kimi-K2.5 release stores its routed experts so, INT4 in groups of 32) are not dequantised: the reader refuses
such a checkpoint, naming them, rather than report every expert as a missing tensor."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.errors import CheckpointError
from actorcore.kernels.mxfp4 import MXFP4_BLOCKS, MXFP4_SCALES, dequantize_mxfp4

_PACKED = ".weight_packed"  # compressed-tensors' pack-quantized weights
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class SafetensorsReader:
    """Lazy, sliced access to the tensors of an HF checkpoint directory (single file or sharded index)."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        from actorcore.model_files import index_files, model_file

        self.directory = directory
        index_path = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        self._files: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        if os.path.lexists(index_path):
            files = index_files(directory, "model.safetensors.index.json")  # every name checked: inside directory
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.lexists(single):
            files, weight_map = ["model.safetensors"], None
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
        for name in files:
            path = model_file(directory, name)
            try:
                handle = safe_open(path, framework="pt")
                keys = list(handle.keys())
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
            self._files[name] = handle
            for key in keys:
                if weight_map is not None and weight_map.get(key) != name:
                    continue
                self.file_of[key] = name
        if weight_map is not None:
            absent = sorted(k for k, v in weight_map.items() if self.file_of.get(k) != v)
            if absent:
                raise CheckpointError(f"{directory}: tensors listed in the index are not in their files: "
                                      f"{', '.join(absent[:10])}")

        packed = sorted(n for n in self.file_of if n.endswith(_PACKED))
        if packed:
            raise CheckpointError(_packed_weights_message(directory, packed))
        # MXFP4 pairs: the weight's name -> (blocks, scales) names.
        self.mxfp4 = {name: (name + MXFP4_BLOCKS, name + MXFP4_SCALES) for name in self._mxfp4_weights()}

    def _mxfp4_weights(self) -> list[str]:
        """The weights stored as MXFP4 (``X_blocks`` and ``X_scales``, bytes): refused with the real cause when
        config.json does not declare MXFP4 or one of a pair is missing, rather than as tensors of a dtype Megatron
        cannot hold."""
        parts: dict[str, set[str]] = {}
        for n in self.file_of:
            for suffix in (MXFP4_BLOCKS, MXFP4_SCALES):
                if n.endswith(suffix) and self._slice(n).get_dtype() == "U8":
                    parts.setdefault(n[: -len(suffix)], set()).add(suffix)
        if not parts:
            return []
        example = sorted(parts)[0]
        method = _quant_method(self.directory)
        if method != "mxfp4":
            declared = f"declares quant_method {method!r}" if method else "declares no quantization_config"
            raise CheckpointError(
                f"{self.directory}: {len(parts)} weights are stored as MXFP4 blocks and scales (e.g. "
                f"{example}{MXFP4_BLOCKS} / {MXFP4_SCALES}), but its config.json {declared}: restore the release's "
                'quantization_config ({"quant_method": "mxfp4", ...}) in config.json')
        unpaired = sorted(name for name, found in parts.items() if len(found) == 1)
        if unpaired:
            have = parts[unpaired[0]].pop()
            missing = MXFP4_SCALES if have == MXFP4_BLOCKS else MXFP4_BLOCKS
            raise CheckpointError(
                f"{self.directory}: the MXFP4 weight {unpaired[0]} has {unpaired[0]}{have} but no "
                f"{unpaired[0]}{missing}" + (f" ({len(unpaired)} weights lack one of their pair)" if len(unpaired) > 1
                                             else "") + ": the checkpoint is incomplete; copy or download it again")
        return sorted(parts)

    def names(self) -> set[str]:
        paired = {n for pair in self.mxfp4.values() for n in pair}
        return (set(self.file_of) - paired) | set(self.mxfp4)

    def __contains__(self, name: str) -> bool:
        return name in self.mxfp4 or name in self.file_of

    def _slice(self, name: str):
        return self._files[self.file_of[name]].get_slice(name)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype stored in the file's header (nothing is read); bf16 for an MXFP4 weight (dequantised)."""
        if name in self.mxfp4:
            return torch.bfloat16
        code = self._slice(name).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.directory}: tensor {name} has dtype {code}, which Megatron weights "
                                  "cannot hold")
        return _SAFETENSORS_DTYPES[code]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4:
            *lead, out_dim, groups, half = self._slice(self.mxfp4[name][0]).get_shape()
            return (*lead, groups * half * 2, out_dim)
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor, or rows/columns ``[start, stop)`` of ``dim`` (only that part is read)."""
        if name in self.mxfp4:
            return self._read_mxfp4(name, dim, start, stop)
        try:
            part = self._slice(name)
            if dim is None:
                return part[:]
            index = (slice(None),) * dim + (slice(start, stop),)
            return part[index]
        except Exception as exc:  # noqa: BLE001 - truncated data surfaces here
            raise CheckpointError(f"{os.path.join(self.directory, self.file_of[name])}: cannot read {name} ({exc})") from None


    def _read_mxfp4(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        """An MXFP4 weight (or experts ``[start, stop)`` of it) dequantised to bf16, ``[E, in, out]``."""
        if dim not in (None, 0):
            raise CheckpointError(f"{self.directory}: {name} is stored as MXFP4 blocks; it can be read whole or by "
                                  f"experts (dim 0), not sliced along dim {dim}")
        blocks, scales = self.mxfp4[name]
        if dim is None:
            start, stop = 0, None
        return dequantize_mxfp4(self.read(blocks, 0, start, stop), self.read(scales, 0, start, stop),
                                torch.bfloat16).transpose(-1, -2).contiguous()




def _quantization_config(directory: str) -> dict:
    """``quantization_config`` of the directory's ``config.json``, or of its ``text_config`` (a VLM's language model,
    e.g. Kimi-K2.5's); empty without one."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    quantization = config.get("quantization_config") or text.get("quantization_config") or {}
    return quantization if isinstance(quantization, dict) else {}


def _quant_method(directory: str) -> str | None:
    """``quantization_config.quant_method`` of the directory's ``config.json`` (None without one)."""
    return _quantization_config(directory).get("quant_method")


def _packed_weights_message(directory: str, packed: list[str]) -> str:
    quantization = _quantization_config(directory)
    declared = (f"quantization_config: quant_method {quantization.get('quant_method')!r}, format "
                f"{quantization.get('format')!r}; " if quantization else "")
    example = packed[0][: -len(_PACKED)]
    return (f"{directory}: {len(packed)} weights are stored quantized and packed by compressed-tensors ({declared}e.g. "
            f"{example}.weight_packed with its .weight_scale / .weight_shape); the Megatron route reads unquantized "
            "weights only: dequantize the checkpoint first (e.g. transformers with the compressed-tensors package: "
            "from_pretrained(..., quantization_config=CompressedTensorsConfig(dequantize=True)), then "
            "save_pretrained), then convert that")


def safetensors_dtype(hf_dir: str, spec: McoreSpec | None = None) -> torch.dtype:
    """The one dtype of an HF checkpoint's tensors, from the safetensors headers.

    Conversion builds the Megatron model in this dtype, not in the one ``config.json`` declares: a model
    saved in float32 with a config saying bfloat16 must come back float32, bit for bit. Tensors that Megatron
    keeps in float32 anyway (``keeps_fp32(name)``: the spec's ``WeightRule.keeps_fp32``, the router's expert bias)
    may be float32 beside 16-bit weights, as the releases store them.
    """
    reader = SafetensorsReader(hf_dir)
    by_dtype: dict[torch.dtype, list[str]] = {}
    exempt = False  # some tensor is one Megatron keeps in float32
    for name in sorted(reader.names()):
        dtype = reader.dtype(name)
        if dtype == torch.float32 and spec is not None and spec.keeps_fp32_hf(name):
            exempt = True
        else:
            by_dtype.setdefault(dtype, []).append(name)
    if len(by_dtype) > 1:
        found = ", ".join(f"{len(names)} in {dtype} (e.g. {names[0]})" for dtype, names in by_dtype.items())
        raise CheckpointError(f"{hf_dir}: the tensors have several dtypes ({found}); a Megatron model holds one "
                              "(only the router's expert bias may stay float32): cast the checkpoint to one dtype "
                              "first")
    if not by_dtype and not exempt:
        raise CheckpointError(f"{hf_dir}: the checkpoint holds no tensors")
    return next(iter(by_dtype)) if by_dtype else torch.float32
