"""Weight export: a stream of HF-named full tensors in buckets, from an HF model (plain or FSDP2-sharded), with
receivers (a plain transformers model, vLLM's ``load_weights``, SGLang's ``update_weights_from_tensor``) and a
disk transport (sharded safetensors in the HF layout) and a process-group transport (``broadcast_stream``); optionally
blockwise FP8 (``export/fp8.py``), and LoRA models merged or as adapters (``export/lora.py``)."""

from actorcore.export.fp8 import BlockwiseFP8, dequantize_fp8_blockwise, quantize_fp8_blockwise
from actorcore.export.receivers import load_into, load_into_sglang, load_into_vllm
from actorcore.export.safetensors_io import save_sharded_safetensors
from actorcore.export.stream import hf_weight_stream, iter_tensors
from actorcore.export.transport import broadcast_stream

__all__ = ["broadcast_stream", "hf_weight_stream", "iter_tensors", "load_into", "load_into_vllm", "load_into_sglang",
           "save_sharded_safetensors", "BlockwiseFP8", "quantize_fp8_blockwise", "dequantize_fp8_blockwise"]
