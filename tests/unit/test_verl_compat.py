"""actorcore.compat.verl: the verl-shaped entry point returns what verl's fused forward means (log-prob of
the next token at each position, per sequence), built on compute_logprobs; boundaries from position_ids."""

from types import SimpleNamespace

import pytest
import torch

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


def _tiled_mlps_that_ran(monkeypatch):
    """The MLP modules whose tiled forward ran (the kernel's forward calls, spied on), in call order."""
    import actorcore.hf.features.tiled_mlp as tiled

    ran, real = [], tiled.tiled_mlp

    def spy(forward_fn, *args, **kwargs):
        ran.append(forward_fn.__self__)
        return real(forward_fn, *args, **kwargs)

    monkeypatch.setattr(tiled, "tiled_mlp", spy)
    return ran


def test_tiled_mlp_flag_runs_tiled_mlp_and_gradients_flow(monkeypatch):
    seqs = _sequences()
    model = build_tiny_model("llama", seed=6)
    apply_monkey_patch(model, use_fused_kernels=True, use_tiled_mlp=True, tiled_mlp_shards=2)
    input_ids, position_ids = _rmpad(seqs)
    ran = _tiled_mlps_that_ran(monkeypatch)
    out = model(input_ids=input_ids, position_ids=position_ids, temperature=1.0)
    assert ran == [layer.mlp for layer in model.model.layers]
    out.log_probs.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.layers[0].mlp.parameters())


def test_boundaries_from_position_id_restarts():
    ids = torch.arange(10)[None] + 3
    # 0..2 | 0..3 | 7, 8 (a sequence that does not start at 0: a discontinuity) | 0
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 7, 8, 0]])
    batch = batch_from_position_ids(ids, pos)
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 9, 10]
    assert batch.max_seqlen == 4 and torch.equal(batch.position_ids, pos[0])


def test_refusals(monkeypatch):
    import actorcore.compat.verl as compat

    model = build_tiny_model("llama")
    monkeypatch.setattr(compat, "_verl_ulysses_importable", lambda: False)
    with pytest.raises(ValueError, match="needs the SP group and verl is not importable"):
        apply_monkey_patch(model, ulysses_sp_size=2)
    fake = SimpleNamespace(sp_size=2, sp_group=object(), sp_rank=0)
    with pytest.raises(ValueError, match="the given SP group has 2 ranks"):
        apply_monkey_patch(model, ulysses_sp_size=4, parallel=fake)
    with pytest.raises(ValueError, match="use_remove_padding=True"):
        apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=False, parallel=fake)
    with pytest.raises(ValueError, match="fused_kernels_backend"):
        apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="cuda")
    with pytest.raises(ValueError, match="use_prefix_grouper=True is not supported.*use_prefix_grouper=False"):
        apply_monkey_patch(model, use_prefix_grouper=True)
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
def test_copy_of_a_verl_patched_model_computes_with_its_own_weights(how, monkeypatch):
    """``ref = copy.deepcopy(actor)`` after apply_monkey_patch: the copy's forward must run the copy's weights."""
    from support.copies import copy_model, scale_weights_of_copy_and_twin

    seqs = _sequences()
    actor = build_tiny_model("llama", seed=2)
    apply_monkey_patch(actor, use_fused_kernels=True, use_tiled_mlp=True, tiled_mlp_shards=2)
    clone = copy_model(actor, how)
    expected = scale_weights_of_copy_and_twin(clone, lambda: build_tiny_model("llama", seed=2))
    input_ids, position_ids = _rmpad(seqs)
    ran = _tiled_mlps_that_ran(monkeypatch)
    out = clone(input_ids=input_ids, position_ids=position_ids, temperature=0.7)
    want_lp, want_ent = _hf_next_token(expected, seqs, 0.7)
    assert (out.log_probs[0] - want_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy[0] - want_ent).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert ran == [layer.mlp for layer in clone.model.layers], "the copy runs its own tiled MLPs"
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


# verl's signature, copied from verl 0.7.1 and 0.9.1 (identical): verl/models/transformers/monkey_patch.py
VERL_PARAMETERS = [("model", None), ("ulysses_sp_size", 1), ("use_remove_padding", True),
                   ("use_fused_kernels", False), ("fused_kernels_backend", None), ("use_prefix_grouper", False),
                   ("use_tiled_mlp", False), ("tiled_mlp_shards", 4)]


def test_signature_is_verls_in_verls_order():
    import inspect

    params = list(inspect.signature(apply_monkey_patch).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [name for name, _ in VERL_PARAMETERS]
    assert [p.default for p in positional[1:]] == [default for _, default in VERL_PARAMETERS[1:]]
    assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} == {"sp_group", "parallel"}


def test_verls_positional_call_means_what_it_means_in_verl():
    """verl's 6th positional argument is use_prefix_grouper: False there must not turn tiled MLP on."""
    model = build_tiny_model("llama", seed=6)
    handle = apply_monkey_patch(model, 1, True, True, None, False)
    assert handle.tiled_mlp_shards is None
    handle.revert()
    handle = apply_monkey_patch(model, 1, True, True, None, False, True, 2)
    assert handle.tiled_mlp_shards == 2
    handle.revert()
    with pytest.raises(ValueError, match="use_prefix_grouper=True is not supported"):
        apply_monkey_patch(model, 1, True, True, None, True)
    assert "forward" not in model.__dict__


def test_liger_backend_is_served_by_our_head_with_a_log_line(caplog):
    seqs = _sequences()
    reference = build_tiny_model("qwen2", seed=4)
    model = build_tiny_model("qwen2", seed=4)
    with caplog.at_level("INFO", logger="actorcore.compat.verl"):
        apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="liger")
    messages = [r.getMessage() for r in caplog.records]
    assert any("liger" in m and "actorcore's fused log-prob head" in m for m in messages), messages
    input_ids, position_ids = _rmpad(seqs)
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, temperature=0.7)
    want_lp, _ = _hf_next_token(reference, seqs, 0.7)
    assert (out.log_probs[0] - want_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]


def _verl_logits_step(model, input_ids, position_ids, inplace, hooked):
    """verl 0.7.1 dp_actor's non-fused path: ``logits_rmpad = output.logits.squeeze(0); logits_rmpad.div_(t)``.
    A forward hook registers a tensor hook on the returned logits, as FSDP2's post-forward does."""
    def post_forward(module, args, kwargs, output):
        output.logits.register_hook(lambda grad: hooked.append(grad.shape) or None)

    handle = model.register_forward_hook(post_forward, with_kwargs=True)
    try:
        output = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    finally:
        handle.remove()
    logits = output.logits.squeeze(0)
    logits = logits.div_(0.7) if inplace else logits / 0.7
    logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(input_ids[0], -1)[:, None])
    model.zero_grad(set_to_none=True)
    logp.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: final logit softcap after the LM head
def test_logits_may_be_divided_in_place_by_verl(model_type):
    """In-place ``div_`` on the returned logits keeps the hooks on them and gives the out-of-place gradients."""
    model = build_tiny_model(model_type, seed=3)
    apply_monkey_patch(model, use_fused_kernels=False)
    input_ids, position_ids = _rmpad(_sequences())
    hooked_out, hooked_in = [], []
    want = _verl_logits_step(model, input_ids, position_ids, inplace=False, hooked=hooked_out)
    got = _verl_logits_step(model, input_ids, position_ids, inplace=True, hooked=hooked_in)
    assert len(hooked_out) == 1 and hooked_in == hooked_out, "the hook on the returned logits was dropped"
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def _critic(model_type, kind, seed):
    from transformers import AutoModelForSequenceClassification

    if kind == "token":
        return build_tiny_model(model_type, task="token_classification", seed=seed)
    from actorcore.testing.tiny_configs import tiny_config

    config = tiny_config(model_type)
    config.num_labels = 1
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_critic_returns_verls_value_logits_per_token(kind):
    """verl's dp_critic reads ``output.logits`` as ``[1, total_nnz, 1]`` from the patched critic's forward."""
    seqs = _sequences()
    reference = _critic("qwen2", kind, seed=7)
    model = _critic("qwen2", kind, seed=7)
    handle = apply_monkey_patch(model, use_remove_padding=True)
    input_ids, position_ids = _rmpad(seqs)
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    assert out.logits.shape == (1, input_ids.shape[1], 1) and out.logits.dtype == torch.float32
    with torch.no_grad():
        if kind == "token":
            want = torch.cat([reference(input_ids=s[None]).logits[0, :, 0] for s in seqs])
        else:  # the score head at every token (HF pools the last one; verl's critic reads every token)
            want = torch.cat([reference.score(reference.model(input_ids=s[None]).last_hidden_state)[0, :, 0]
                              for s in seqs])
    assert (out.logits[0, :, 0].detach() - want).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    out.logits.sum().backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="use_fused_kernels=True does not apply"):
        handle.revert()
        apply_monkey_patch(model, use_fused_kernels=True)


def test_shift_labels_of_verl_09_are_accepted_and_checked():
    """verl 0.9's FSDP engine passes ``shift_labels`` (its rolled input_ids) to the fused forward."""
    seqs = _sequences()
    reference = build_tiny_model("qwen2", seed=4)
    model = build_tiny_model("qwen2", seed=4)
    apply_monkey_patch(model, use_fused_kernels=True)
    input_ids, position_ids = _rmpad(seqs)
    rolled = torch.roll(input_ids, shifts=-1, dims=1)  # crosses each sequence's end, as verl's does
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, temperature=0.7, shift_labels=rolled,
                    return_dict=True)
    want_lp, _ = _hf_next_token(reference, seqs, 0.7)
    assert (out.log_probs[0] - want_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    wrong = rolled.clone()
    wrong[0, 2] += 1  # inside the first sequence
    with pytest.raises(ValueError, match="shift_labels differ from the next token within a sequence"):
        model(input_ids=input_ids, position_ids=position_ids, shift_labels=wrong)
    with pytest.raises(ValueError, match=r"shift_labels must be \(1, total_nnz\)"):
        model(input_ids=input_ids, position_ids=position_ids, shift_labels=rolled[:, :-1])
