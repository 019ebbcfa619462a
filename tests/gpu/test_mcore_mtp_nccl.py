"""Multi-token prediction on the Megatron route with NCCL (2 GPUs), DeepSeek-V3's layout and Qwen3-Next's /
Qwen3.5-MoE's ``mtp.*`` head (the latter's experts stacked, as its release stores them): at TP=2 (sequence
parallelism) and PP=2 the MTP checkpoint exports back bit-exact, the main log-probs equal transformers' fp32 forward,
and the MTP log-probs, loss and ``eh_proj`` gradient equal the plain-torch MTP forward on the CPU. Skipped without two
CUDA devices or megatron-core."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from actorcore.testing.tolerances import TOL


pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

LENGTHS = (9, 2, 12, 5, 3)
MTP_SCALE = 0.3


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 131, (n,), generator=gen) for n in LENGTHS]


def _worker(rank: int, world_size: int, tp: int, pp: int, mtp_dir: str) -> dict:
    from transformers import AutoConfig

    import actorcore as ac
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.run.forward import compute_logprobs, mtp_loss
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict

    parallel = McoreParallel(tp=tp, pp=pp)
    context = initialize_megatron(parallel)
    hf_config = AutoConfig.from_pretrained(mtp_dir)
    mcore_model = build_gpt_model(hf_config, parallel, mtp=True,
                                  expert_layout=checkpoint_expert_layout(mtp_dir, hf_config))
    chunks = mcore_model.chunks
    load_hf_into_mcore(mcore_model, mtp_dir)
    batch = ac.pack(_sequences())
    out = compute_logprobs(mcore_model, batch, mtp_loss_scale=MTP_SCALE,
                           loss_fn=lambda o, b: o.log_probs.sum() * 0.0)
    grads = [p.grad.cpu() for n, p in chunks[-1].named_parameters() if n.endswith("eh_proj.weight")]
    return dict(state={k: v.cpu() for k, v in gather_hf_state_dict(mcore_model).items()},
                log_probs=out.log_probs.cpu(), mtp=out.mtp_log_probs.cpu(), device=out.mtp_log_probs.device.type,
                loss=mtp_loss(out.mtp_log_probs, batch.to(out.mtp_log_probs.device)).cpu(), grads=grads,
                tp_rank=context.tp_rank)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_next", "qwen3_5_moe_text"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_mtp_on_nccl(tp, pp, model_type):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file
    from support.mcore_nccl import run_nccl

    from support.mtp import reference_mtp, write_mtp_checkpoint

    with tempfile.TemporaryDirectory() as root:
        mtp_dir, donor_dir = write_mtp_checkpoint(root, model_type)
        results = run_nccl(_worker, 2, (tp, pp, mtp_dir))
        reference = load_file(os.path.join(mtp_dir, "model.safetensors"))
        main_ref, mtp_rows, ref_loss, ref_grad = reference_mtp(mtp_dir, donor_dir, _sequences(), MTP_SCALE)
    tol, grad_tol = TOL["mcore_cuda_vs_hf_fp32"], TOL["grad_mcore_cuda_vs_hf_fp32_rel"]
    for rank, got in enumerate(results):
        assert sorted(got["state"]) == sorted(reference), rank
        for name, tensor in reference.items():
            assert got["state"][name].dtype == tensor.dtype and torch.equal(got["state"][name], tensor), (rank, name)
        assert got["device"] == "cuda"
        torch.testing.assert_close(got["log_probs"], main_ref, atol=tol, rtol=0)
        torch.testing.assert_close(got["mtp"][0], torch.cat(mtp_rows), atol=tol, rtol=0)
        torch.testing.assert_close(got["loss"], ref_loss, atol=tol, rtol=0)
        for grad in got["grads"]:
            rows = grad.shape[0]
            expected = ref_grad[got["tp_rank"] * rows:(got["tp_rank"] + 1) * rows]
            scale = expected.abs().max()
            torch.testing.assert_close(grad / scale, expected / scale, atol=grad_tol, rtol=0)
    assert any(got["grads"] for got in results)
