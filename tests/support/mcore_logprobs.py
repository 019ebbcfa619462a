"""The Megatron route's log-prob cases: tiny HF models, packed batches, a case run on each rank and the packed
transformers reference it is checked against."""

from __future__ import annotations

import torch

from actorcore.testing.tolerances import TOL


LENGTHS = [(5, 11, 3, 9), (14, 2, 7), (1, 6, 12)]


def logprob_sequences() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [[torch.randint(3, 131, (n,), generator=gen) for n in lengths] for lengths in LENGTHS]


def logprob_batches(pad_to: int | None = None):
    import actorcore as ac
    from actorcore.batch import pad_to_multiple

    batches = [ac.pack(sequences) for sequences in logprob_sequences()]
    if pad_to:
        batches = [pad_to_multiple(b, pad_to) if b.num_tokens % pad_to else b for b in batches]
    return batches


def reference_logprobs_packed(model, sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T]`` log-probs and entropy in packed order from the model's own padded forward (fp32)."""
    from actorcore.testing.reference import reference_logprobs, right_padded

    return reference_logprobs(model, *right_padded(sequences))


def logprobs_case(model_type: str, tp: int, pp: int, ep: int, directory: str, overrides: dict) -> dict:
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    hf = tiny_hf(model_type, **overrides)
    parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
    context = initialize_megatron(parallel)
    assert (context.tp_size, context.pp_size, context.ep_size) == (tp, pp, ep)
    model = build_gpt_model(hf.config, parallel)
    load_hf_into_mcore(model, directory)
    # PP needs equal micro-batch token counts: pad every batch to 32 tokens (a padding segment).
    batches = logprob_batches(pad_to=32 if pp > 1 else None)

    got = compute_logprobs(model, batches)
    with torch.no_grad():
        ref = [reference_logprobs_packed(hf, sequences) for sequences in logprob_sequences()]

    # Forward-backward through the schedule: gradient of the final norm and the first layer's input norm.
    def loss_fn(out, batch):
        return -out.log_probs.sum()

    fb = compute_logprobs(model, batches, loss_fn=loss_fn)
    hf.zero_grad()
    for sequences in logprob_sequences():
        (reference_logprobs_packed(hf, sequences)[0].sum() * (-1.0 / len(LENGTHS))).backward()
    grads = {}
    for chunk in model.chunks:
        for name, param in chunk.named_parameters():
            if name == "decoder.final_layernorm.weight":
                grads["model.norm.weight"] = (param.grad.clone(), hf.model.norm.weight.grad.clone())
            if name == "decoder.layers.0.input_layernorm.weight" and chunk.decoder.layers[0].layer_number == 1:
                grads["model.layers.0.input_layernorm.weight"] = (
                    param.grad.clone(), hf.model.layers[0].input_layernorm.weight.grad.clone())
    return {"got": [(o.log_probs, o.entropy) for o in got], "fb": [o.log_probs for o in fb], "ref": ref,
            "grads": grads}


def tiny_hf(model_type: str, **overrides):
    from support.mcore_weights import randomize_constant_tensors

    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model(model_type, seed=5, **overrides)
    randomize_constant_tensors(model, seed=1)
    return model


def check_logprobs(results: list[dict]) -> None:
    tol = TOL["mcore_vs_hf_fp32"]
    seen_grads = set()
    for rank, result in enumerate(results):
        for (lp, ent), (ref_lp, ref_ent), fb in zip(result["got"], result["ref"], result["fb"]):
            assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0)
            torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0)
            assert bool((lp != 0).any())
        for name, (grad, ref_grad) in result["grads"].items():
            seen_grads.add(name)
            scale = ref_grad.abs().max()
            torch.testing.assert_close(grad, ref_grad, atol=TOL["grad_mcore_vs_hf_fp32_rel"] * scale, rtol=0,
                                       msg=f"rank {rank} {name}")
    assert seen_grads == {"model.norm.weight", "model.layers.0.input_layernorm.weight"}
