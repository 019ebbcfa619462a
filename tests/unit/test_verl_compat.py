"""actorcore.compat.verl: the verl-shaped entry point returns what verl's fused forward means (log-prob of
the next token at each position, per sequence), built on compute_logprobs; boundaries from position_ids."""

from types import SimpleNamespace

import pytest
import torch

import actorcore as ac
from actorcore.compat.verl import apply_monkey_patch, batch_from_position_ids
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

LENGTHS = (6, 1, 13, 4)


def _sequences():
    g = torch.Generator().manual_seed(8)
    return [torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]


def _rmpad(seqs):
    """verl's remove-padding inputs: (1, total_nnz) ids and positions restarting at 0 per sequence."""
    return torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]


def _hf_next_token(model, seqs, temperature):
    """Per sequence, plain HF forward: log p(token t+1) and entropy at position t, 0 at the last position."""
    lps, ents = [], []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=s[None]).logits[0].float() / temperature
            logp = torch.log_softmax(logits, -1)
            lp = torch.zeros(len(s))
            lp[:-1] = logp[:-1].gather(-1, s[1:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            ent[-1] = 0.0
            lps.append(lp)
            ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_fused_forward_matches_plain_hf_per_sequence(model_type):
    seqs = _sequences()
    reference = build_tiny_model(model_type, seed=4)
    model = build_tiny_model(model_type, seed=4)
    handle = apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True)
    input_ids, position_ids = _rmpad(seqs)
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, temperature=0.7, use_cache=False)
    want_lp, want_ent = _hf_next_token(reference, seqs, 0.7)
    assert out.log_probs.shape == out.entropy.shape == input_ids.shape
    assert out.log_probs.dtype == torch.float32
    assert (out.log_probs[0] - want_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy[0] - want_ent).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    handle.revert()
    assert "forward" not in model.__dict__
    assert torch.equal(model(input_ids=seqs[0][None]).logits, reference(input_ids=seqs[0][None]).logits)


def test_logits_forward_without_fused_kernels_matches_hf():
    seqs = _sequences()
    reference = build_tiny_model("gemma2", seed=4)  # final logit softcap applied too
    model = build_tiny_model("gemma2", seed=4)
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=False)
    input_ids, position_ids = _rmpad(seqs)
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids).logits[0]
        want = torch.cat([reference(input_ids=s[None]).logits[0] for s in seqs])
    assert logits.shape == want.shape
    assert (logits - want).abs().max().item() <= TOL["packed_vs_hf_fp32"]


def test_tiled_mlp_flag_runs_tiled_mlp_and_gradients_flow():
    seqs = _sequences()
    model = build_tiny_model("llama", seed=6)
    apply_monkey_patch(model, use_fused_kernels=True, use_tiled_mlp=True, tiled_mlp_shards=2)
    input_ids, position_ids = _rmpad(seqs)
    out = model(input_ids=input_ids, position_ids=position_ids, temperature=1.0)
    assert [layer.mlp.forward.calls for layer in model.model.layers] == [1] * model.config.num_hidden_layers
    out.log_probs.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.layers[0].mlp.parameters())


def test_boundaries_from_position_id_restarts():
    ids = torch.arange(10)[None] + 3
    # 0..2 | 0..3 | 7, 8 (a sequence that does not start at 0: a discontinuity) | 0
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 7, 8, 0]])
    batch = batch_from_position_ids(ids, pos)
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 9, 10]
    assert batch.max_seqlen == 4 and torch.equal(batch.position_ids, pos[0])


def test_refusals():
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match="needs the SP group"):
        apply_monkey_patch(model, ulysses_sp_size=2)
    fake = SimpleNamespace(sp_size=2, sp_group=object(), sp_rank=0)
    with pytest.raises(ValueError, match="the given SP group has 2 ranks"):
        apply_monkey_patch(model, ulysses_sp_size=4, parallel=fake)
    with pytest.raises(ValueError, match="use_remove_padding=True"):
        apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=False, parallel=fake)
    with pytest.raises(ValueError, match="fused_kernels_backend"):
        apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="liger")
    apply_monkey_patch(model, use_fused_kernels=True)
    ids, pos = _rmpad(_sequences())
    with pytest.raises(ValueError, match="attention_mask=None"):
        model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match=r"\(1, total_nnz\)"):
        model(input_ids=ids.reshape(2, -1), position_ids=pos.reshape(2, -1))
    with pytest.raises(ValueError, match="already patched"):
        apply_monkey_patch(model, use_fused_kernels=True)


def test_zero_tokens_is_a_clear_error():
    model = build_tiny_model("llama")
    apply_monkey_patch(model, use_fused_kernels=True)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"no tokens \(shape \(1, 0\)\).*drop empty micro-batches"):
        model(input_ids=empty, position_ids=empty)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_of_a_verl_patched_model_computes_with_its_own_weights(how):
    """``ref = copy.deepcopy(actor)`` after apply_monkey_patch: the copy's forward must run the copy's weights."""
    from actorcore.testing.copies import copy_model, scale_weights_of_copy_and_twin

    seqs = _sequences()
    actor = build_tiny_model("llama", seed=2)
    apply_monkey_patch(actor, use_fused_kernels=True, use_tiled_mlp=True, tiled_mlp_shards=2)
    clone = copy_model(actor, how)
    expected = scale_weights_of_copy_and_twin(clone, lambda: build_tiny_model("llama", seed=2))
    input_ids, position_ids = _rmpad(seqs)
    out = clone(input_ids=input_ids, position_ids=position_ids, temperature=0.7)
    want_lp, want_ent = _hf_next_token(expected, seqs, 0.7)
    assert (out.log_probs[0] - want_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy[0] - want_ent).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert [layer.mlp.forward.calls for layer in clone.model.layers] == [1, 1], "the copy runs its tiled MLP"
    out.log_probs.sum().backward()
    assert all(p.grad is None for p in actor.parameters()), "gradient reached the original's weights"
    assert all(p.grad is not None for p in clone.model.layers[0].mlp.parameters())


def test_parallel_context_is_shared_by_copies_and_refuses_pickling_with_groups():
    import subprocess
    import sys

    code = (
        "import copy, pickle, torch.distributed as dist\n"
        "from actorcore.parallel import ParallelContext\n"
        "assert pickle.loads(pickle.dumps(ParallelContext())).sp_size == 1\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "ctx = ParallelContext(sp_group=dist.group.WORLD)\n"
        "assert copy.deepcopy(ctx) is ctx and copy.copy(ctx) is ctx\n"
        "try:\n"
        "    pickle.dumps(ctx)\n"
        "    raise SystemExit('pickled a context with groups')\n"
        "except pickle.PicklingError as err:\n"
        "    assert 'sp_group' in str(err) and 'state_dict' in str(err), err\n"
        "dist.destroy_process_group()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
