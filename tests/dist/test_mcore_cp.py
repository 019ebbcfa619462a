"""Context parallelism on the Megatron route (gloo, 4 CPU ranks, one spawned group): per-token log-probs, entropy
and every parameter's gradient equal plain transformers' fp32 forward, at TP=2 x CP=2 (mistral: a sliding window
shorter than the sequences, GQA), CP=4 (qwen2: q/k/v biases), PP=2 x CP=2 (llama), CP=2 x DP=2 (deepseek_v3:
MLA with its own RoPE path, MoE) and CP=2 x EP=2 (qwen3_moe); a critic's values at CP=4. Sequences of 1 and 2
tokens are shorter than 2*CP and get padded. Gradients are averaged over the data x context parallel group
first, as Megatron's DDP does (the schedule scales each rank's loss by cp)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL
from support.mcore_cp import cp_layout, cp_reference, cp_sequences, cp_tiny_hf


pytest.importorskip("megatron.core")

# (model_type, overrides, tp, pp, cp, ep): 4 ranks each.
LAYOUTS = [("mistral", {}, 2, 1, 2, 1), ("qwen2", {}, 1, 1, 4, 1),
           ("llama", {"tie_word_embeddings": False}, 1, 2, 2, 1), ("deepseek_v3", {}, 1, 1, 2, 1),
           ("qwen3_moe", {}, 1, 1, 2, 2)]
CRITIC_CP = 4


def _critic(directory: str) -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    import actorcore as ac
    from actorcore.mcore.run.forward import compute_values
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(cp=CRITIC_CP)
    initialize_megatron(parallel)
    model = build_gpt_model(AutoConfig.from_pretrained(directory), parallel, value_head=True)
    load_hf_into_mcore(model, directory)
    values = compute_values(model, [ac.pack(s) for s in cp_sequences()])
    ps.destroy_model_parallel()
    return values


def _worker(rank: int, world_size: int, directories: list[str], critic_directory: str) -> dict:
    from actorcore.mcore.cpu_runtime import CpuRuntime

    with CpuRuntime():
        layouts = [cp_layout(model_type, tp, pp, cp, ep, directory)
                   for (model_type, _, tp, pp, cp, ep), directory in zip(LAYOUTS, directories)]
        return {"layouts": layouts, "values": _critic(critic_directory)}


def _reference_values(critic, sequences: list[torch.Tensor]) -> torch.Tensor:
    """``[T]`` values in packed order: ``ForTokenClassification.forward``'s 1-label logits at each token."""
    from actorcore.testing.reference import padded_logits, padded_to_packed, right_padded

    ids, mask = right_padded(sequences)
    return padded_to_packed(padded_logits(critic, ids, mask)[..., 0].float(), mask)


@pytest.mark.slow
def test_context_parallel_equals_transformers():
    with tempfile.TemporaryDirectory() as root:
        directories, references = [], []
        for i, (model_type, overrides, *_sizes) in enumerate(LAYOUTS):
            hf = cp_tiny_hf(model_type, overrides)
            hf.save_pretrained(f"{root}/{i}")
            directories.append(f"{root}/{i}")
            references.append(cp_reference(hf))
        critic = cp_tiny_hf("qwen2", {}, task="token_classification")
        critic.save_pretrained(f"{root}/critic")
        with torch.no_grad():
            ref_values = [_reference_values(critic, sequences) for sequences in cp_sequences()]
        results = run_distributed(_worker, 4, args=(directories, f"{root}/critic"))
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    for rank, result in enumerate(results):
        for got, ref in zip(result["values"], ref_values):
            assert got.dtype == torch.float32 and got.shape == ref.shape
            torch.testing.assert_close(got, ref, atol=tol, rtol=0, msg=f"rank {rank} critic values at cp=4")
    for rank, per_layout in enumerate(r["layouts"] for r in results):
        for (model_type, _, tp, pp, cp, ep), result, (ref_out, ref_grads) in zip(LAYOUTS, per_layout, references):
            where = f"rank {rank} {model_type} tp={tp} pp={pp} cp={cp} ep={ep}"
            # Every attention call took the context-parallel path (2 layers over the pipeline stages, 3 batches,
            # forward-only and forward-backward).
            assert result["trace"] == {"varlen_attention:at_positions": 2 // pp * 3 * 2}, where
            for (lp, ent), fb, (ref_lp, ref_ent) in zip(result["got"], result["fb"], ref_out):
                assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape, where
                torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=where)
                torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=where)
                torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0, msg=where)
            assert set(ref_grads) <= set(result["grads"]), where
            for name, ref_grad in ref_grads.items():
                scale = ref_grad.abs().max()  # 0 only for an expert no token was routed to: then exactly 0
                torch.testing.assert_close(result["grads"][name], ref_grad, atol=grad_tol * scale, rtol=0,
                                           msg=f"{where} {name}")
