"""LoRA (PEFT) models on the HF route: per token equal to the PEFT model's own forward, gradients only on the
adapters and equal to PEFT's own, through compute_logprobs, compute_loss and a tiled-MLP patch."""

from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.testing.reference import reference_logprobs, right_padded
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _lora_model(model_type="llama", targets=TARGETS):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_tiny_model(model_type, seed=2),
                                peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():  # lora_B starts at zero, which would make the adapters invisible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return model


def _sequences():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 131, (n,), generator=g) for n in (1, 9, 17, 4)]


def _adapter_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_adapter_grads_close(got, want):
    assert set(got) == set(want) and got and all("lora_" in n for n in got), sorted(got)
    for name, g in want.items():
        rel = ((got[name] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
        assert rel <= TOL["grad_packed_vs_hf_fp32_rel"], (name, rel)


@pytest.mark.parametrize("model_type, targets", [("llama", TARGETS), ("qwen3_moe", ["q_proj", "v_proj", "o_proj"])])
def test_lora_logprobs_and_gradients_equal_peft_forward(model_type, targets):
    model = _lora_model(model_type, targets)
    seqs = _sequences()
    ids, mask = right_padded(seqs)
    ref_lp, ref_ent = reference_logprobs(model, ids, mask, temperature=0.8)
    (ref_lp.sum() + ref_ent.sum()).backward()
    want = _adapter_grads(model)
    model.zero_grad(set_to_none=True)
    trace = Counter()
    out = ac.compute_logprobs(model, ac.pack(seqs), temperature=0.8, trace=trace)
    assert trace["attention:actorcore_packed"] == model.config.num_hidden_layers
    assert (out.log_probs - ref_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy - ref_ent).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    (out.log_probs.sum() + out.entropy.sum()).backward()
    _assert_adapter_grads_close(_adapter_grads(model), want)


def test_lora_compute_loss_and_tiled_mlp():
    model = _lora_model()
    seqs = _sequences()
    batch = ac.pack(seqs)
    adv = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(1))
    out = ac.compute_logprobs(model, batch)
    (-(out.log_probs * adv).sum()).backward()
    want = _adapter_grads(model)
    model.zero_grad(set_to_none=True)
    ac.compute_loss(model, batch, lambda lp, ent, a: -lp * a, token_args=(adv,)).loss.backward()
    _assert_adapter_grads_close(_adapter_grads(model), want)
    model.zero_grad(set_to_none=True)
    handle = ac.patch_model(model, tiled_mlp_shards=3)
    trace = Counter()
    tiled = ac.compute_logprobs(model, batch, trace=trace)
    (-(tiled.log_probs * adv).sum()).backward()
    assert trace["tiled_mlp:forward"] == len(model.get_base_model().model.layers)
    assert (tiled.log_probs - out.log_probs).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    _assert_adapter_grads_close(_adapter_grads(model), want)
    handle.revert()


def test_lora_on_the_lm_head_is_refused():
    model = _lora_model(targets=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="leave lm_head out of the LoRA target_modules"):
        ac.compute_logprobs(model, ac.pack(_sequences()))
