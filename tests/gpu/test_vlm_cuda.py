"""CUDA: packed VLM log-probs (vision tower on the GPU, packed varlen attention in the decoder) equal the
padded HF forward per token, in fp32 and bf16. Skipped without CUDA."""

from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_vlm_on_cuda_matches_padded(model_type, dtype):
    import actorcore as ac
    from actorcore.kernels.attention.varlen import choose_backend
    from actorcore.testing.reference_vlm import reference_logprobs_vlm
    from actorcore.testing.tiny_vlm import build_tiny_vlm, mixed_samples
    from actorcore.hf.vlm.packing import pack_multimodal

    model = build_tiny_vlm(model_type, dtype=dtype, attn_implementation="sdpa").cuda()
    samples = mixed_samples(model)
    batch = pack_multimodal(model, [s.input_ids for s in samples], [s.multimodal for s in samples]).to("cuda")
    text = model.config.text_config
    backend = choose_backend(torch.device("cuda"), dtype, None, 0.0,
                             head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    trace = Counter()
    with torch.no_grad():
        out = ac.compute_logprobs(model, batch, temperature=0.7, trace=trace)
        ref_lp, ref_ent = reference_logprobs_vlm(model, samples, temperature=0.7)
    layers = model.config.text_config.num_hidden_layers
    assert trace["attention:actorcore_packed"] == layers
    assert trace[f"varlen_attention:{backend}"] == layers
    # Same convention as test_packed_attention_cuda: fp32 (TF32 matmuls may be on) and bf16 kernel rounding.
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (out.log_probs - ref_lp.to(out.log_probs.device)).abs().max().item() < tol
    assert (out.entropy - ref_ent.to(out.entropy.device)).abs().max().item() < tol
