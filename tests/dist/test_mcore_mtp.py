"""DeepSeek-V3 multi-token prediction on the Megatron route (gloo, CPU): a checkpoint with MTP tensors named as in
the release (``model.layers.{num_hidden_layers}.*``) converts HF -> Megatron -> HF bit-exact at TP=2 and PP=2, the
MTP depth's per-token log-probs equal an independent plain-torch MTP forward on each packed sequence (targets
never cross into the next sequence), the main head's log-probs are bitwise those of the model built without MTP,
and the default build drops the MTP tensors."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed

pytest.importorskip("megatron.core")

LENGTHS = (9, 2, 12, 5, 3)  # a 2-token sequence has no MTP target, a 3-token one a single target
MTP_SCALE = 0.3


def _randomize_constants(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Norm weights (ones) and biases (zeros) get distinct values, so swapped mappings cannot pass."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
            state[name] = tensor + torch.randn(tensor.shape, generator=gen) * 0.1


def _write_checkpoint(root: str) -> tuple[str, str]:
    """(MTP checkpoint dir, donor dir). The donor is a tiny DeepSeek-V3 with one more layer, whose last layer
    becomes the MTP layer's decoder layer; the MTP-only tensors are random, the embedding and head copies equal
    the main model's (as in the release)."""
    from safetensors.torch import load_file, save_file

    from actorcore.testing.tiny_configs import build_tiny_model, tiny_config

    config = tiny_config("deepseek_v3", num_nextn_predict_layers=1)
    layers = config.num_hidden_layers
    donor = build_tiny_model("deepseek_v3", seed=5, num_hidden_layers=layers + 1)
    donor_dir, mtp_dir = os.path.join(root, "donor"), os.path.join(root, "mtp")
    donor.save_pretrained(donor_dir)
    state = load_file(os.path.join(donor_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    _randomize_constants(state, gen)
    save_file(state, os.path.join(donor_dir, "model.safetensors"), metadata={"format": "pt"})
    hidden = config.hidden_size
    mtp = f"model.layers.{layers}."
    state.update({
        mtp + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        mtp + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        mtp + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=gen),
        mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        mtp + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        mtp + "shared_head.head.weight": state["lm_head.weight"].clone(),
    })
    os.makedirs(mtp_dir)
    save_file(state, os.path.join(mtp_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(mtp_dir)
    return mtp_dir, donor_dir


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 131, (n,), generator=gen) for n in LENGTHS]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp(mtp_dir: str, donor_dir: str, sequences: list[torch.Tensor]):
    """Plain-torch DeepSeek-V3 MTP forward, one sequence at a time (transformers' fp32 model for the main hidden
    states and the decoder layer): h' = eh_proj(cat(enorm(emb(t+1)), hnorm(h))) -> decoder layer ->
    shared_head.norm -> output layer; the log-prob of token t+2 at position t, aligned to the scored token.
    Returns (main log-probs, MTP log-probs, MTP loss) with the loss's gradient in eh_proj.grad."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from actorcore.testing.reference import reference_logprobs, right_padded

    main = AutoModelForCausalLM.from_pretrained(mtp_dir, attn_implementation="eager").eval()
    donor = AutoModelForCausalLM.from_pretrained(donor_dir, attn_implementation="eager").eval()
    layers, eps = main.config.num_hidden_layers, main.config.rms_norm_eps
    state = load_file(os.path.join(mtp_dir, "model.safetensors"))
    p = {k[len(f"model.layers.{layers}."):]: v for k, v in state.items() if k.startswith(f"model.layers.{layers}.")}
    eh_proj = p["eh_proj.weight"].clone().requires_grad_(True)
    with torch.no_grad():
        main_ref = reference_logprobs(main, *right_padded(sequences))[0]
    rows, losses, counts = [], [], []
    for ids in sequences:
        n = len(ids)
        row = torch.zeros(n)
        if n >= 3:
            with torch.no_grad():
                h = main.model(input_ids=ids[None]).last_hidden_state[0]  # after the final norm
                emb = main.model.embed_tokens(ids[1:])
            x = torch.cat([_rms(emb, p["enorm.weight"], eps), _rms(h[:-1], p["hnorm.weight"], eps)], -1) @ eh_proj.T
            position = torch.arange(n - 1)[None]
            mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
            y = donor.model.layers[layers](x[None], attention_mask=mask, position_ids=position,
                                           position_embeddings=donor.model.rotary_emb(x[None], position))
            y = y[0] if isinstance(y, tuple) else y
            logits = _rms(y[0], p["shared_head.norm.weight"], eps) @ p["shared_head.head.weight"].T
            logp = torch.log_softmax(logits.float(), -1)[torch.arange(n - 2), ids[2:]]
            row[2:] = logp.detach()
            losses.append(-logp.sum())
            counts.append(n - 2)
        rows.append(row)
    loss = torch.stack(losses).sum() / sum(counts)
    (MTP_SCALE * loss).backward()
    return main_ref, rows, loss.detach(), eh_proj.grad


def _worker(rank: int, world_size: int, mtp_dir: str, saved_dir: str) -> dict:
    """TP=2 then PP=2 (the MTP layer on the last stage): load, export, log-probs with the MTP loss (forward and
    backward); at TP=2 also the default build (MTP dropped), at PP=2 a Megatron checkpoint for the CLI."""
    import actorcore as ac
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from actorcore.mcore.checkpoint import load_hf_into_mcore
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.dist_checkpoint import save_mcore_checkpoint
    from actorcore.mcore.forward import compute_logprobs, mtp_loss
    from actorcore.mcore.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.weight_stream import gather_hf_state_dict

    hf_config = AutoConfig.from_pretrained(mtp_dir)
    batch = ac.pack(_sequences())
    out: dict = {}
    with CpuRuntime():
        for name, parallel in (("tp2", McoreParallel(tp=2)), ("pp2", McoreParallel(pp=2))):
            context = initialize_megatron(parallel)
            chunks = build_gpt_model(hf_config, parallel, mtp=True)
            load_hf_into_mcore(chunks, mtp_dir, context)
            result = compute_logprobs(chunks, batch, context, mtp_loss_scale=MTP_SCALE,
                                      loss_fn=lambda o, b: o.log_probs.sum() * 0.0)
            got = dict(state=gather_hf_state_dict(chunks, context), log_probs=result.log_probs,
                       mtp=result.mtp_log_probs, loss=mtp_loss(result.mtp_log_probs, batch), tp_rank=context.tp_rank,
                       grads=[p.grad.clone() for n, p in chunks[-1].named_parameters()
                              if n.endswith("eh_proj.weight") and p.grad is not None])
            if name == "tp2":
                plain_chunks = build_gpt_model(hf_config, parallel)  # the default: MTP tensors dropped
                load_hf_into_mcore(plain_chunks, mtp_dir, context)
                got["plain"] = compute_logprobs(plain_chunks, batch, context).log_probs
                got["plain_names"] = sorted(gather_hf_state_dict(plain_chunks, context))
                try:
                    compute_logprobs(plain_chunks, batch, context, mtp_loss_scale=1.0)
                except ValueError as exc:
                    got["refusal"] = str(exc)
            else:
                save_mcore_checkpoint(chunks, saved_dir, mtp_dir, 128)
            out[name] = got
            parallel_state.destroy_model_parallel()
    return out


def test_mtp_roundtrip_loss_and_packing():
    from safetensors.torch import load_file

    from actorcore.testing.tolerances import TOL

    from actorcore.cli.convert import main as convert
    from actorcore.testing.checkpoints import load_checkpoint_tensors

    with tempfile.TemporaryDirectory() as root:
        mtp_dir, donor_dir = _write_checkpoint(root)
        saved, back = os.path.join(root, "mcore-pp2"), os.path.join(root, "back")
        results = run_distributed(_worker, 2, args=(mtp_dir, saved))
        reference = load_file(os.path.join(mtp_dir, "model.safetensors"))
        main_ref, mtp_rows, ref_loss, ref_grad = reference_mtp(mtp_dir, donor_dir, _sequences())
        # The Megatron checkpoint written at PP=2 (MTP on the last stage) converts back with the CLI, bit-exact.
        assert convert(["mcore-to-hf", saved, back]) == 0
        exported = load_checkpoint_tensors(back)
    assert sorted(exported) == sorted(reference)
    assert all(torch.equal(exported[k], v) and exported[k].dtype == v.dtype for k, v in reference.items())
    layers = 2
    mtp_names = {n for n in reference if n.startswith(f"model.layers.{layers}.")}
    assert f"model.layers.{layers}.mlp.experts.3.up_proj.weight" in mtp_names  # the MTP layer is a MoE layer
    ref_main = main_ref
    ref_mtp = torch.cat(mtp_rows)
    for result in results:
        for name, got in result.items():
            state = got["state"]
            assert sorted(state) == sorted(reference), (name, set(state) ^ set(reference))
            for key, tensor in reference.items():
                assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), (name, key)
            if name == "tp2":
                assert set(got["plain_names"]) == set(reference) - mtp_names
                # The main head is unchanged by MTP (bitwise).
                assert torch.equal(got["log_probs"], got["plain"])
                assert "mtp=True" in got["refusal"]
            # ... and equals transformers' fp32 forward.
            torch.testing.assert_close(got["log_probs"], ref_main, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            # MTP depth 1, per token, against the per-sequence reference: 0 at each sequence's first two tokens.
            assert got["mtp"].shape == (1, sum(LENGTHS)), name
            starts = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)
            assert torch.all(got["mtp"][0, starts] == 0) and torch.all(got["mtp"][0, starts + 1] == 0), name
            torch.testing.assert_close(got["mtp"][0], ref_mtp, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            torch.testing.assert_close(got["loss"], ref_loss, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            # The MTP loss's gradient in eh_proj (column-parallel: this TP rank's rows).
            for grad in got["grads"]:
                rows = grad.shape[0]
                expected = ref_grad[got["tp_rank"] * rows:(got["tp_rank"] + 1) * rows]
                scale = expected.abs().max()
                torch.testing.assert_close(grad / scale, expected / scale, atol=TOL["grad_mcore_vs_hf_fp32_rel"],
                                           rtol=0)
    assert any(r["pp2"]["grads"] for r in results) and all(r["tp2"]["grads"] for r in results)


def test_mtp_refusals():
    """Asking for MTP where there is none, or under context parallelism, is a ValueError saying what to do."""
    from types import SimpleNamespace

    from actorcore.archs.spec import UnsupportedArchitectureError
    from actorcore.mcore.forward import _check_mtp
    from actorcore.mcore.model import mtp_layer_count
    from actorcore.testing.tiny_configs import tiny_config

    assert mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=1), False) is None
    assert mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=1), True) == 1
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=0), True)
    with pytest.raises(UnsupportedArchitectureError, match="multi-token-prediction"):
        mtp_layer_count(tiny_config("qwen3"), True)
    chunk = SimpleNamespace(config=SimpleNamespace(mtp_num_layers=1, pipeline_model_parallel_layout=None))
    assert _check_mtp([chunk], SimpleNamespace(cp_size=1), 0.5) == 1
    assert _check_mtp([chunk], SimpleNamespace(cp_size=1), None) == 0
    with pytest.raises(ValueError, match="context parallelism"):
        _check_mtp([chunk], SimpleNamespace(cp_size=2), 0.5)
    with pytest.raises(ValueError, match="non-negative"):
        _check_mtp([chunk], SimpleNamespace(cp_size=1), -1.0)
