"""Weight export: a stream of HF-named full tensors in buckets, from an HF model (plain or FSDP2-sharded), optionally
blockwise FP8 (``export/fp8.py``) and with LoRA models merged or as adapters (``export/lora.py``); receivers (a plain
transformers model, vLLM's ``load_weights``, SGLang's ``update_weights_from_tensor``) and three transports: disk
(sharded safetensors in the HF layout), a process group (``broadcast_stream``), and another process on the same
machine (``ipc_send`` / ``ipc_receive``: CUDA IPC on the GPU, shared memory on the CPU)."""

from actorcore.export.fp8 import BlockwiseFP8, dequantize_fp8_blockwise, quantize_fp8_blockwise
from actorcore.export.ipc import IpcReceiver, IpcSendStats, TransportError, ipc_receive, ipc_send
from actorcore.export.receivers import load_into, load_into_sglang, load_into_vllm
from actorcore.export.safetensors_io import save_sharded_safetensors
from actorcore.export.stream import hf_weight_stream, iter_tensors
from actorcore.export.transport import broadcast_stream

__all__ = ["BlockwiseFP8", "IpcReceiver", "IpcSendStats", "TransportError", "broadcast_stream",
           "dequantize_fp8_blockwise", "hf_weight_stream", "ipc_receive", "ipc_send", "iter_tensors", "load_into",
           "load_into_sglang", "load_into_vllm", "quantize_fp8_blockwise", "save_sharded_safetensors"]
