"""Weight export from FSDP2 (gloo, CPU): every rank iterates hf_weight_stream of a sharded model; what the receivers
get is bitwise the unsharded model's (checkpoint names: what save_pretrained writes; model names: load_into), each
bucket within its bound, and the safetensors directory written by rank 0 round-trips through from_pretrained."""

import pytest
import torch

from actorcore.testing.distributed import run_distributed

MODEL_TYPES = ["llama", "qwen3_moe", "gemma2"]
BUCKET_BYTES = 20_000


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank, world_size, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from actorcore.export import hf_weight_stream, iter_tensors, load_into, save_sharded_safetensors
    from actorcore.testing.tiny_configs import build_tiny_model

    # 4 ranks: a 2-D mesh (HSDP: replicate over 2, shard over 2), "any mesh" beyond the flat one; 1 rank: a mesh
    # of one, whose tensors the stream reads locally (no collective)
    mesh = init_device_mesh("cpu", (world_size,)) if world_size <= 2 else init_device_mesh(
        "cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    results = {}
    for model_type in MODEL_TYPES:
        model = _shard(build_tiny_model(model_type), mesh)
        assert any(isinstance(p, DTensor) for p in model.parameters())
        buckets = [[(n, t.numel() * t.element_size()) for n, t in b]
                   for b in hf_weight_stream(model, bucket_bytes=BUCKET_BYTES, names="model")]
        checkpoint = dict(iter_tensors(hf_weight_stream(model, bucket_bytes=BUCKET_BYTES)))
        bf16 = dict(iter_tensors(hf_weight_stream(model, bucket_bytes=BUCKET_BYTES, dtype=torch.bfloat16)))
        plain = build_tiny_model(model_type, seed=7)
        load_into(plain, hf_weight_stream(model, bucket_bytes=BUCKET_BYTES, names="model"))
        save_sharded_safetensors(hf_weight_stream(model, bucket_bytes=BUCKET_BYTES), f"{out_dir}/{model_type}",
                                 max_shard_bytes=50_000, config=model.config, write=rank == 0)
        results[model_type] = dict(buckets=buckets, checkpoint=checkpoint, bf16=bf16, loaded=plain.state_dict())
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fsdp2_stream_is_bitwise_the_unsharded_model(tmp_path, world_size):
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from actorcore.testing.tiny_configs import build_tiny_model

    results = run_distributed(_worker, world_size, args=(str(tmp_path),))
    for model_type in MODEL_TYPES:
        model = build_tiny_model(model_type)
        state = model.state_dict()
        checkpoint = revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(state), model))
        from_disk = AutoModelForCausalLM.from_pretrained(str(tmp_path / model_type), dtype=torch.float32).state_dict()
        assert sorted(from_disk) == sorted(state)
        for name, tensor in state.items():
            assert from_disk[name].dtype == tensor.dtype and torch.equal(from_disk[name], tensor), (model_type, name)
        for rank, per_model in enumerate(results):
            got = per_model[model_type]
            where = f"{model_type} rank {rank}"
            for bucket in got["buckets"]:
                assert sum(b for _, b in bucket) <= BUCKET_BYTES or len(bucket) == 1, (where, bucket)
            assert len(got["buckets"]) > 1
            assert sorted(got["checkpoint"]) == sorted(checkpoint), where
            for name, tensor in checkpoint.items():
                assert got["checkpoint"][name].dtype == tensor.dtype, (where, name)
                assert torch.equal(got["checkpoint"][name], tensor), (where, name)
                assert torch.equal(got["bf16"][name], tensor.to(torch.bfloat16)), (where, name)
            for name, tensor in state.items():
                assert got["loaded"][name].dtype == tensor.dtype, (where, name)
                assert torch.equal(got["loaded"][name], tensor), (where, name)


def _broadcast_worker(rank, world_size):
    import torch.distributed as dist

    from actorcore.export import broadcast_stream, hf_weight_stream, load_into
    from actorcore.testing.tiny_configs import build_tiny_model

    group = dist.new_group(list(range(world_size)))
    src = world_size - 1  # not rank 0: group ranks, not only the default
    odd = [[("scalar", torch.tensor(2.5, dtype=torch.float64)), ("ids", torch.arange(5, dtype=torch.int64)),
            ("flags", torch.tensor([True, False])),
            ("half", torch.randn(3, 2, generator=torch.Generator().manual_seed(1)).bfloat16())],
           [], [("last", torch.ones(1, 7))]]
    # received tensors are views of one buffer per bucket: cloned to travel back through torch.save
    received_odd = [[(n, t.clone()) for n, t in b] for b in broadcast_stream(odd if rank == src else None, group, src)]
    model = build_tiny_model("qwen3_moe", seed=0 if rank == src else 5)
    stream = hf_weight_stream(model, bucket_bytes=BUCKET_BYTES, names="model") if rank == src else None
    load_into(model, broadcast_stream(stream, group, src))
    with pytest.raises(ValueError, match="passes its stream"):
        next(broadcast_stream(None if rank == src else [], group, src))
    return dict(odd=received_odd, state=model.state_dict())


def test_broadcast_stream_gives_every_rank_the_senders_tensors():
    from actorcore.testing.tiny_configs import build_tiny_model

    results = run_distributed(_broadcast_worker, 2)
    want = build_tiny_model("qwen3_moe").state_dict()
    for rank, got in enumerate(results):
        assert [[n for n, _ in b] for b in got["odd"]] == [["scalar", "ids", "flags", "half"], ["last"]]
        sent = {"scalar": torch.tensor(2.5, dtype=torch.float64), "ids": torch.arange(5),
                "flags": torch.tensor([True, False]),
                "half": torch.randn(3, 2, generator=torch.Generator().manual_seed(1)).bfloat16(),
                "last": torch.ones(1, 7)}
        for name, tensor in (p for b in got["odd"] for p in b):
            assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name]), (rank, name)
        for name, tensor in want.items():
            assert got["state"][name].dtype == tensor.dtype and torch.equal(got["state"][name], tensor), (rank, name)
