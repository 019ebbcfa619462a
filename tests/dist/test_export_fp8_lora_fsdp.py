"""FP8 and LoRA export from FSDP2 (2 gloo ranks): every rank gets the same bytes as one process streaming the
unsharded model: blockwise FP8 weights and scales of a MoE model, a LoRA model merged and its adapters alone."""

import torch

from actorcore.testing.distributed import run_distributed

BUCKET_BYTES = 20_000
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _moe_model():
    from actorcore.testing.tiny_configs import build_tiny_model

    return build_tiny_model("qwen3_moe")


def _lora_model():
    import peft

    from actorcore.testing.tiny_configs import build_tiny_model

    model = peft.get_peft_model(build_tiny_model("llama", seed=2),
                                peft.LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model


def _streams():
    """(model builder, {label: stream kwargs}) compared; each model is built (and sharded) once."""
    return [(_moe_model, {"fp8_moe": dict(quantize="fp8_blockwise", dtype=torch.bfloat16)}),
            (_lora_model, {"lora_merged": {}, "lora_merged_fp8": dict(quantize="fp8_blockwise"),
                           "lora_adapters": dict(lora="adapters")})]


def _collect(model, kwargs):
    """The stream as a dict; fp8 tensors as their bytes (uint8 views)."""
    from actorcore.export import hf_weight_stream, iter_tensors

    return {n: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for n, t in iter_tensors(hf_weight_stream(model, bucket_bytes=BUCKET_BYTES, **kwargs))}


def _worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from actorcore.archs.spec import task_model

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for build, streams in _streams():
        model = build()
        for layer in task_model(model).model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters())  # the adapters too
        results.update({label: _collect(model, kwargs) for label, kwargs in streams.items()})
    return results


def test_fsdp2_fp8_and_lora_streams_are_the_single_process_bytes():
    results = run_distributed(_worker, 2)
    for build, streams in _streams():
        model = build()
        for label, kwargs in streams.items():
            want = _collect(model, kwargs)
            assert any(n.endswith("_scale_inv") for n in want) == ("quantize" in kwargs)
            for rank, got in enumerate(results):
                assert list(got[label]) == list(want), (label, rank)
                for name, tensor in want.items():
                    assert got[label][name].dtype == tensor.dtype, (label, rank, name)
                    assert torch.equal(got[label][name], tensor), (label, rank, name)
