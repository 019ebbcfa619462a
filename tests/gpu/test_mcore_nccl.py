"""The Megatron route on GPUs with NCCL (2 GPUs): at TP=2, PP=2 and EP=2 a tiny model loads from HF, exports back
bit-exact, and its per-token log-probs / entropy equal plain transformers' fp32 forward; at CP=2 the gradients
too. NCCL has no CPU tensors, so any CPU buffer handed to a collective (the pipeline's broadcast of the last
stage's outputs, object gathers without a current device) fails here and nowhere on the CPU tests. Also: ``actorcore convert --tp 2``
round trip on a CUDA machine. Skipped without two CUDA devices or megatron-core."""

from __future__ import annotations

import os

import pytest
import torch

from actorcore.testing.tolerances import TOL
from support.mcore_nccl import run_nccl


pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

LENGTHS = [(5, 11, 3, 9), (14, 2, 7), (1, 6, 12)]
PAD_TO = 32  # pipeline parallelism needs one token count for every micro-batch
BUCKET_BYTES = 20_000


def _sequences() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [[torch.randint(3, 131, (n,), generator=gen) for n in lengths] for lengths in LENGTHS]


def _worker(rank: int, world_size: int, tp: int, pp: int, ep: int, hf_dir: str) -> dict:
    import actorcore as ac
    from actorcore.batch import pad_to_multiple
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import mcore_weight_stream
    from transformers import AutoConfig

    parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
    initialize_megatron(parallel)
    mcore_model = build_gpt_model(AutoConfig.from_pretrained(hf_dir), parallel)
    chunks = mcore_model.chunks
    assert next(chunks[0].parameters()).is_cuda
    load_hf_into_mcore(mcore_model, hf_dir)
    exported = {k: v.cpu() for k, v in gather_hf_state_dict(mcore_model).items()}
    buckets = [[(n, t.cpu(), t.device.type) for n, t in bucket]  # several tensors a bucket, over NCCL
               for bucket in mcore_weight_stream(mcore_model, bucket_bytes=BUCKET_BYTES)]
    batches = [ac.pack(s) for s in _sequences()]
    batches = [pad_to_multiple(b, PAD_TO) if b.num_tokens % PAD_TO else b for b in batches]
    outputs = compute_logprobs(mcore_model, batches)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return {"exported": exported, "buckets": buckets,
            "got": [(o.log_probs.cpu(), o.entropy.cpu(), o.log_probs.device.type) for o in outputs]}


@pytest.mark.parametrize("model_type,tp,pp,ep", [
    ("qwen2", 2, 1, 1),
    ("llama", 1, 2, 1),
    ("qwen3_moe", 1, 1, 2),
    # The 2026 families (written for the two-GPU machine; on gloo in tests/dist; the hybrids in
    # test_mcore_hybrid_cuda.py, the VLMs in test_mcore_vlm_cuda.py):
    ("glm4_moe", 1, 1, 2),
    ("gpt_oss", 1, 2, 1),
])
def test_mcore_on_nccl(tmp_path, model_type, tp, pp, ep):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from actorcore.testing.reference import reference_logprobs, right_padded
    from actorcore.testing.tiny_configs import build_tiny_model

    hf = build_tiny_model(model_type, seed=5)
    hf_dir = str(tmp_path / "hf")
    hf.save_pretrained(hf_dir)
    results = run_nccl(_worker, tp * pp * ep, (tp, pp, ep, hf_dir))
    source = load_file(os.path.join(hf_dir, "model.safetensors"))
    with torch.no_grad():
        ref = [reference_logprobs(hf, *right_padded(s)) for s in _sequences()]
    tol = TOL["mcore_cuda_vs_hf_fp32"]
    for rank, result in enumerate(results):
        assert sorted(result["exported"]) == sorted(source), rank
        for name, tensor in source.items():
            got = result["exported"][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (rank, name)
        streamed = {n: t for bucket in result["buckets"] for n, t, _ in bucket}
        assert sorted(streamed) == sorted(source) and len(result["buckets"]) > 2, rank
        for bucket in result["buckets"]:
            assert all(device == "cuda" for _, _, device in bucket)
            assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t, _ in bucket) <= BUCKET_BYTES
        for name, tensor in source.items():
            assert torch.equal(streamed[name], tensor), (rank, name)
        for (lp, ent, device), (ref_lp, ref_ent) in zip(result["got"], ref):
            assert device == "cuda"
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=f"rank {rank} log-probs")
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=f"rank {rank} entropy")


def _cp_worker(rank: int, world_size: int, hf_dir: str, cp_comm: str, dtype: torch.dtype) -> dict:
    import collections

    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoConfig

    import actorcore as ac
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(cp=2)
    initialize_megatron(parallel)
    mcore_model = build_gpt_model(AutoConfig.from_pretrained(hf_dir), parallel, cp_comm_type=cp_comm, dtype=dtype)
    chunks = mcore_model.chunks
    load_hf_into_mcore(mcore_model, hf_dir)
    trace: collections.Counter = collections.Counter()
    for layer in chunks[0].decoder.layers:
        layer.self_attention.core_attention.trace = trace
    batches = [ac.pack(s) for s in _sequences()]
    outputs = compute_logprobs(mcore_model, batches, loss_fn=lambda out, batch: -out.log_probs.sum())
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    params = list(chunks[0].parameters())
    for param in params:  # what Megatron's DDP does: average over the data x context parallel ranks
        dist.all_reduce(param.grad, group=group)
        param.grad /= dist.get_world_size(group)
    weights = [p.data for p in params]
    for p in params:
        p.data = p.grad
    grads = {k: v.float().cpu() for k, v in gather_hf_state_dict(mcore_model).items()}
    for p, w in zip(params, weights):
        p.data = w
    parallel_state.destroy_model_parallel()
    return {"got": [(o.log_probs.cpu(), o.entropy.cpu(), o.log_probs.device.type) for o in outputs],
            "grads": grads, "trace": dict(trace)}


# fp32 runs the plain attention paths (flash kernels take 16-bit inputs); bf16 the flash ones.
CP_PATHS = {("all_gather", torch.float32): "varlen_attention:at_positions",
            ("p2p", torch.float32): "varlen_attention:cp_ring",
            ("all_gather", torch.bfloat16): "varlen_attention:at_positions:torch_varlen",
            ("p2p", torch.bfloat16): "varlen_attention:cp_ring_flash"}


@pytest.mark.parametrize("cp_comm,dtype,model_type", [("all_gather", torch.float32, "mistral"),
                                                      ("p2p", torch.float32, "mistral"),
                                                      ("all_gather", torch.bfloat16, "qwen3"),
                                                      ("p2p", torch.bfloat16, "qwen3")])
def test_mcore_context_parallel_on_nccl(tmp_path, cp_comm, dtype, model_type):
    """CP=2 over NCCL with the all-gather and with the ring (cp_comm_type="p2p", NCCL's batched send/recv):
    log-probs, entropy and every parameter's gradient (averaged over the CP ranks, as Megatron's DDP does) equal
    transformers' fp32 forward. fp32 (mistral: GQA, a sliding window shorter than the sequences) runs the plain
    attention paths and is held to fp32 tolerances; bf16 (qwen3) runs the flash ones (the varlen call over key
    prefixes, the ring's per-block flash calls) and is held to the bf16 decoder's."""
    pytest.importorskip("megatron.core")
    from actorcore.testing.reference import reference_logprobs, right_padded
    from actorcore.testing.tiny_configs import build_tiny_model

    hf = build_tiny_model(model_type, seed=5)
    hf_dir = str(tmp_path / "hf")
    hf.save_pretrained(hf_dir)
    results = run_nccl(_cp_worker, 2, (hf_dir, cp_comm, dtype))
    ref = []
    for sequences in _sequences():
        lp, ent = reference_logprobs(hf, *right_padded(sequences))
        (lp.sum() * (-1.0 / len(LENGTHS))).backward()
        ref.append((lp.detach(), ent.detach()))
    if dtype == torch.float32:
        tol, grad_tol = TOL["mcore_cuda_vs_hf_fp32"], TOL["grad_mcore_cuda_vs_hf_fp32_rel"]
    else:
        tol, grad_tol = TOL["mcore_bf16_cuda_vs_hf_fp32"], TOL["grad_bf16_vs_fp32_rel_norm"]
    for rank, result in enumerate(results):
        assert result["trace"] == {CP_PATHS[cp_comm, dtype]: 2 * len(LENGTHS)}, rank
        for (lp, ent, device), (ref_lp, ref_ent) in zip(result["got"], ref):
            assert device == "cuda"
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=f"rank {rank} log-probs")
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=f"rank {rank} entropy")
        for name, param in hf.named_parameters():
            got, want = result["grads"][name], param.grad
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=grad_tol * want.abs().max(), rtol=0,
                                           msg=f"rank {rank} {name}")
            else:
                assert ((got - want).norm() / want.norm()).item() < grad_tol, f"rank {rank} {name}"


def test_convert_cli_tp2_on_cuda(tmp_path):
    """The CLI's rank processes on a CUDA machine (gloo world, model on the GPU): bit-exact round trip."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from actorcore.cli.convert import main
    from support.checkpoints import load_checkpoint_tensors
    from actorcore.testing.tiny_configs import build_tiny_model

    src, mcore, back = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    build_tiny_model("qwen2", seed=3).save_pretrained(src)
    assert main(["hf-to-mcore", src, mcore, "--tp", "2"]) == 0
    assert main(["mcore-to-hf", mcore, back]) == 0
    ref, got = load_file(os.path.join(src, "model.safetensors")), load_checkpoint_tensors(back)
    assert sorted(ref) == sorted(got)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
