"""Weight export from the Megatron route (4 gloo ranks, CPU): every rank iterates ``mcore_weight_stream`` of a model
sharded over TP=2 x PP=2 (x EP=2 for the MoE); what every rank gets is bitwise the HF checkpoint the model was
loaded from (per-expert names for Qwen3-MoE, no lm_head when tied), each bucket within its bound; rank 0's sharded
safetensors directory has an index naming every tensor once, and ``load_into`` fills a fresh HF model from it.
One spawned group runs every case (Megatron's state is rebuilt when the layout changes)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed


pytest.importorskip("megatron.core")

BUCKET_BYTES = 12_000  # several tensors per bucket, and buckets mixing tensors of both pipeline stages
SHARD_BYTES = 30_000
# (name, model_type, overrides, layout); the MoE runs with TP, PP and EP at once
CASES = [
    ("dense", "qwen2", {}, dict(tp=2, pp=2)),
    ("tied", "qwen2", {"tie_word_embeddings": True}, dict(tp=2, pp=2)),
    ("moe", "qwen3_moe", {}, dict(tp=2, pp=2, ep=2)),
]


def _save(root: str) -> None:
    from support.mcore_weights import randomize_constant_tensors

    from actorcore.testing.tiny_configs import build_tiny_model

    for name, model_type, overrides, _ in CASES:
        model = build_tiny_model(model_type, seed=7, **overrides)
        randomize_constant_tensors(model)  # norms and biases distinct, so a swapped pair could not pass
        model.save_pretrained(os.path.join(root, name))


def _worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig, AutoModelForCausalLM

    from actorcore.export import iter_tensors, load_into, save_sharded_safetensors
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import mcore_weight_stream

    results = {}
    with CpuRuntime():
        layout = None
        for name, _, _, sizes in CASES:
            if layout != sizes and ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            layout = sizes
            parallel = McoreParallel(**sizes)
            context = initialize_megatron(parallel)
            directory = os.path.join(root, name)
            config = AutoConfig.from_pretrained(directory)
            model = build_gpt_model(config, parallel)
            load_hf_into_mcore(model, directory)

            buckets = [[(n, t.clone()) for n, t in bucket]
                       for bucket in mcore_weight_stream(model, bucket_bytes=BUCKET_BYTES)]
            bf16 = dict(iter_tensors(mcore_weight_stream(model, bucket_bytes=BUCKET_BYTES,
                                                dtype=torch.bfloat16)))
            saved = os.path.join(root, f"{name}-saved")
            weight_map = save_sharded_safetensors(mcore_weight_stream(model, bucket_bytes=BUCKET_BYTES),
                                                  saved, SHARD_BYTES, config=config, write=rank == 0)
            loaded = None
            stream = mcore_weight_stream(model, bucket_bytes=BUCKET_BYTES)
            if rank == 0 and name != "moe":  # load_into takes model names: a transformers-5 MoE fuses its experts
                hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                load_into(hf_model, stream)
                loaded = {k: v.clone() for k, v in hf_model.state_dict().items()}
            else:
                for _ in stream:  # the other ranks take part in the gathers
                    pass
            results[name] = {"buckets": buckets, "bf16": bf16, "weight_map": weight_map, "loaded": loaded,
                             "ranks": (context.tp_rank, context.pp_rank, context.ep_rank)}
    return results


@pytest.mark.dist
def test_mcore_stream_tp_pp_ep_is_the_hf_checkpoint():
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as root:
        _save(root)
        results = run_distributed(_worker, 4, args=(root,))
        for name, _, overrides, sizes in CASES:
            reference = load_file(os.path.join(root, name, "model.safetensors"))
            if name == "moe":
                assert any(".experts.3.gate_proj.weight" in n for n in reference)  # per-expert checkpoint names
            if name == "tied":
                assert "lm_head.weight" not in reference
            assert len({r[name]["ranks"] for r in results}) == 4, "every rank is a distinct (tp, pp, ep) position"
            for rank, result in enumerate(results):
                got = result[name]
                # every rank receives the whole model, bitwise the checkpoint it was loaded from
                streamed = [n for bucket in got["buckets"] for n, _ in bucket]
                assert sorted(streamed) == sorted(reference), (name, rank, set(streamed) ^ set(reference))
                state = dict(iter_tensor for bucket in got["buckets"] for iter_tensor in bucket)
                for key, tensor in reference.items():
                    assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), (name, rank, key)
                    assert torch.equal(got["bf16"][key], tensor.to(torch.bfloat16)), (name, rank, key)
                # the bound: no bucket over it, except a tensor larger than the bound alone
                sizes_ = [[t.numel() * t.element_size() for _, t in bucket] for bucket in got["buckets"]]
                assert len(sizes_) > 3
                for bucket in sizes_:
                    assert sum(bucket) <= BUCKET_BYTES or len(bucket) == 1, (name, bucket)
                # buckets are filled: a bucket and the next one's first tensor would not fit together
                for bucket, following in zip(sizes_, sizes_[1:]):
                    assert sum(bucket) + following[0] > BUCKET_BYTES, (name, bucket, following)
            # the sharded directory: written by rank 0 only, its index names every tensor once, in its shard
            weight_map = results[0][name]["weight_map"]
            assert all(r[name]["weight_map"] == {} for r in results[1:])
            saved = os.path.join(root, f"{name}-saved")
            with open(os.path.join(saved, "model.safetensors.index.json")) as f:
                index = json.load(f)
            assert index["weight_map"] == weight_map and sorted(weight_map) == sorted(reference)
            shards = sorted(set(weight_map.values()))
            assert len(shards) > 1
            seen: list[str] = []
            for shard in shards:
                tensors = load_file(os.path.join(saved, shard))
                seen += list(tensors)
                for key, tensor in tensors.items():
                    assert weight_map[key] == shard and torch.equal(tensor, reference[key]), (name, key)
            assert sorted(seen) == sorted(reference)
            assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
            # load_into: a fresh transformers model holds the checkpoint's weights (dense and tied)
            if name != "moe":
                loaded = results[0][name]["loaded"]
                for key, tensor in reference.items():
                    assert torch.equal(loaded[key], tensor), (name, key)
                if overrides.get("tie_word_embeddings"):
                    assert torch.equal(loaded["lm_head.weight"], reference["model.embed_tokens.weight"])
