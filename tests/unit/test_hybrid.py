"""Hybrid linear-attention models (Gated DeltaNet + gated full attention) on the HF route, one process.

The kernels against independent plain references (per-sequence ``F.conv1d``; the token-by-token delta rule);
the models against their own ``ForCausalLM.forward`` run one sequence at a time (log-probs, entropy, every
parameter's gradient); packing isolation, with each of the two boundaries (the conv's and the delta rule's state)
broken on its own to show that the isolation test catches it; the trace self-check; copies of a model carrying
the packed forward.
"""

import contextlib
import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import actorcore as ac
from actorcore.archs import get_spec, registered_model_types
from actorcore.hf.features.attention import PackingNotAppliedError
from actorcore.kernels.linear_attention.delta_rule_chunks import delta_rule_blocks, delta_rule_whole_pack
from actorcore.kernels.linear_attention.packed import causal_conv1d_packed, gated_delta_rule_packed
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

HYBRID = [m for m in registered_model_types()
          if get_spec(m).linear_attention is not None and get_spec(m).vision is None]  # text models
LINEAR = "linear_attention:actorcore_packed"
# Lengths 1 and 2 (shorter than the conv), 70 (two delta-rule chunks of 64).
LENGTHS = [9, 1, 70, 2, 17]


def _sequences(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 131, (n,), generator=g) for n in lengths]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_hybrid_archs_are_registered():
    assert set(HYBRID) == {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
    for vlm in ("qwen3_5", "qwen3_5_moe"):  # the image-text models (tests/unit/test_vlm.py)
        assert get_spec(vlm).linear_attention == get_spec("qwen3_5_text").linear_attention


# ---- kernels against plain references ----


def test_packed_conv_restarts_at_every_boundary():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 2, 7, 3, 12]
    x, w, b = torch.randn(sum(lengths), 10, generator=g), torch.randn(10, 4, generator=g), torch.randn(10, generator=g)
    trace = Counter()
    for bias in (None, b):
        got = causal_conv1d_packed(x, w, bias, _cu(lengths), "silu", trace=trace)
        want = torch.cat([F.silu(F.conv1d(s.T[None], w[:, None], bias, padding=3, groups=10)[0, :, :len(s)].T)
                          for s in x.split(lengths)])
        assert (got - want).abs().max().item() <= TOL["linear_kernel_vs_reference_fp32"]
    assert trace["causal_conv1d:torch"] == 2


def _delta_rule_token_by_token(q, k, v, g, beta, lengths):
    """The gated delta rule as written, one token at a time, state zeroed at each sequence start (fp32)."""
    rep = v.shape[1] // q.shape[1]
    q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))  # L2 norm, as defined
    q, k = q.repeat_interleave(rep, 1) * q.shape[-1] ** -0.5, k.repeat_interleave(rep, 1)
    outs, t = [], 0
    for n in lengths:
        S = torch.zeros(v.shape[1], q.shape[-1], v.shape[-1])
        for i in range(t, t + n):
            S = S * g[i].exp()[:, None, None]
            delta = beta[i][:, None] * (v[i] - torch.einsum("mkv,mk->mv", S, k[i]))
            S = S + k[i][:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("mkv,mk->mv", S, q[i]))
        t += n
    return torch.stack(outs)


def test_packed_delta_rule_equals_token_by_token_reference_with_gradients():
    g = torch.Generator().manual_seed(1)
    lengths = [1, 65, 3, 130]  # chunk edges at 64 and 128 inside sequences
    T = sum(lengths)
    q, k = torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g)
    v = torch.randn(T, 4, 6, generator=g)
    decay, beta = -torch.rand(T, 4, generator=g) * 0.5, torch.rand(T, 4, generator=g)
    inputs = [x.requires_grad_() for x in (q, k, v, decay, beta)]
    trace = Counter()
    got = gated_delta_rule_packed(*inputs, _cu(lengths), trace=trace)
    w = torch.randn(got.shape, generator=g)
    got_grads = torch.autograd.grad((got * w).sum(), inputs)
    want = _delta_rule_token_by_token(*inputs, lengths)
    want_grads = torch.autograd.grad((want * w).sum(), inputs)
    assert trace["gated_delta_rule:torch"] == 1
    assert type(got.grad_fn).__name__ == "_DeltaRuleBlocksBackward"  # the torch backend's lean training path ran
    assert (got - want).abs().max().item() <= TOL["linear_kernel_vs_reference_fp32"]
    for a, b in zip(got_grads, want_grads):
        assert ((a - b).abs().max() / b.abs().max()).item() <= TOL["linear_kernel_grad_vs_reference_fp32_rel"]


def _delta_rule_inputs(lengths, key_heads, value_heads, dim, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = (torch.randn(T, key_heads, dim, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(T, value_heads, dim - 2, generator=g, dtype=dtype)
    decay, beta = -torch.rand(T, value_heads, generator=g, dtype=dtype) * 0.5, torch.rand(T, value_heads, generator=g,
                                                                                          dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


@pytest.mark.parametrize("block_tokens", [64, 192, 100_000])  # one step per block; blocks of 1-3 steps; one block
def test_delta_rule_blocks_equal_reference_and_whole_pack_per_element(block_tokens):
    """The blocks path (hand-written backward) against the token-by-token reference and the whole-pack autograd
    path: output and the gradients of q, k, v, g, beta, per element; sequences end inside blocks (0-token one too)."""
    lengths = [1, 65, 3, 0, 130, 64, 200]
    inputs = _delta_rule_inputs(lengths, 2, 4, 8, torch.float32)
    got = delta_rule_blocks(*inputs, _cu(lengths), True, 0.3, block_tokens=block_tokens)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(6))
    got_grads = torch.autograd.grad((got * w).sum(), inputs)
    for name, fn in (("reference", lambda *x: _delta_rule_token_by_token(*x, lengths) * (0.3 / 8**-0.5)),
                     ("whole pack", lambda *x: delta_rule_whole_pack(*x, _cu(lengths), True, 0.3))):
        want = fn(*inputs)
        want_grads = torch.autograd.grad((want * w).sum(), inputs)
        assert (got - want).abs().max().item() <= TOL["linear_kernel_vs_reference_fp32"], name
        for x, a, b in zip("q k v g beta".split(), got_grads, want_grads):
            rel = ((a - b).abs().max() / b.abs().max()).item()
            assert rel <= TOL["linear_kernel_grad_vs_reference_fp32_rel"], f"{name}: grad of {x} off by {rel:.2e}"


def test_delta_rule_blocks_gradcheck_fp64():
    """The hand-written backward against numerical differences in fp64 (chunks of 4, blocks of 2 chunks, two value
    heads per key head, sequences ending at different steps)."""
    lengths = [3, 9, 1, 5]
    inputs = _delta_rule_inputs(lengths, 1, 2, 4, torch.float64)
    assert torch.autograd.gradcheck(
        lambda *x: delta_rule_blocks(*x, _cu(lengths), True, 0.7, chunk_size=4, block_tokens=8), inputs)


def _saved_by_autograd(fn):
    """``(result, [(shape, bytes)] of every tensor autograd saved for backward while fn ran)``."""
    saved = []

    def pack(x):
        saved.append((tuple(x.shape), x.numel() * x.element_size()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        return fn(), saved


def test_delta_rule_blocks_saves_a_fraction_of_the_whole_pack_path():
    """What the blocks path keeps for backward (its inputs and each block's start state) against the whole-pack
    autograd path's pack-sized fp32 intermediates."""
    lengths = [100, 300, 7, 250]
    inputs = _delta_rule_inputs(lengths, 2, 4, 16, torch.float32)
    _, blocks = _saved_by_autograd(lambda: delta_rule_blocks(*inputs, _cu(lengths), True, 0.3, block_tokens=128))
    _, whole = _saved_by_autograd(lambda: delta_rule_whole_pack(*inputs, _cu(lengths), True, 0.3))
    input_bytes = sum(x.numel() * x.element_size() for x in inputs)
    blocks_bytes, whole_bytes = sum(b for _, b in blocks), sum(b for _, b in whole)
    assert blocks_bytes < 1.5 * input_bytes and whole_bytes > 10 * blocks_bytes, (blocks_bytes, whole_bytes)


def test_gated_norm_is_recomputed_in_backward():
    """The layer's gated RMSNorm keeps only its two inputs for backward (transformers' torch norm keeps about six
    ``[tokens * M, V]`` tensors, four of them fp32)."""
    model = build_tiny_model("qwen3_5_text")
    seqs = _sequences()
    out, saved = _saved_by_autograd(lambda: ac.compute_logprobs(model, ac.pack(seqs)))
    rows = sum(len(s) for s in seqs) * model.config.linear_num_value_heads
    assert out.log_probs.requires_grad
    assert sum(1 for shape, _ in saved if shape == (rows, model.config.linear_value_head_dim)) == 2


def test_kernels_refuse_bad_input():
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="cu_seqlens ends at 4 but there are 5 tokens"):
        causal_conv1d_packed(x, torch.randn(4, 3), None, _cu([4]))
    with pytest.raises(ValueError, match="activations"):
        causal_conv1d_packed(x, torch.randn(4, 3), None, _cu([5]), "gelu")
    with pytest.raises(ValueError, match="3 value heads cannot share 2 key heads"):
        gated_delta_rule_packed(torch.randn(5, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 3, 4), torch.zeros(5, 3),
                                torch.ones(5, 3), _cu([5]))


# ---- models against their own forward, one sequence at a time ----


def _per_sequence_reference(model, seqs, temperature):
    """Log-probs and entropies from the model's own forward, batch 1, no packing (differentiable)."""
    lps, ents = [], []
    for s in seqs:
        logits = model(input_ids=s[None], use_cache=False).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        lps.append(torch.cat([logp.new_zeros(1), logp[:-1].gather(-1, s[1:, None])[:, 0]]))
        ents.append(torch.cat([logp.new_zeros(1), -(logp[:-1].exp() * logp[:-1]).sum(-1)]))
    return torch.cat(lps), torch.cat(ents)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", HYBRID)
def test_equals_own_forward_per_sequence_with_gradients(model_type):
    model = build_tiny_model(model_type)
    seqs = _sequences()
    batch = ac.pack(seqs)
    g = torch.Generator().manual_seed(2)
    w_lp, w_ent = torch.randn(batch.num_tokens, generator=g), torch.randn(batch.num_tokens, generator=g)
    trace = Counter()
    out = ac.compute_logprobs(model, batch, temperature=0.7, trace=trace)
    ((out.log_probs * w_lp).sum() + (out.entropy * w_ent).sum()).backward()
    packed = _grads(model)
    model.zero_grad(set_to_none=True)
    lp, ent = _per_sequence_reference(model, seqs, 0.7)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    want = _grads(model)

    types = model.config.layer_types
    assert trace[LINEAR] == types.count("linear_attention") and trace["gated_delta_rule:torch"] == trace[LINEAR]
    assert trace["attention:actorcore_packed"] == types.count("full_attention")
    tol = TOL["hybrid_vs_own_forward_fp32"]
    assert (out.log_probs - lp).abs().max().item() <= tol
    assert (out.entropy - ent).abs().max().item() <= tol
    assert packed.keys() == want.keys() and any("linear_attn" in n for n in want)
    grad_tol = TOL["grad_hybrid_moe_vs_hf_fp32_rel" if get_spec(model_type).mlp_kind == "moe"
                   else "grad_packed_vs_hf_fp32_rel"]
    for name in want:
        rel = ((packed[name] - want[name]).abs().max() / want[name].abs().max().clamp(min=1e-30)).item()
        assert rel <= grad_tol, f"{name}: relative grad difference {rel:.2e}"
    assert "forward" not in model.model.layers[0].linear_attn.__dict__, "the per-call forward was not restored"


def test_verify_passes():
    assert ac.verify(build_tiny_model("qwen3_next", seed=1), ac.pack(_sequences(seed=3))).ok


# ---- packing isolation, and each boundary shown to be needed ----


def _long_memory(model):
    """Slow decay in every linear-attention head (small ``A``), as trained models have in some heads: a state that
    leaked across a boundary would then not have decayed away (the random init's decays reach exp(-16) per token)."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(-4.0)
    return model


def _isolation_diffs(model, seed=4):
    """Change sequence 1's tokens: ``(max change of the other sequences' outputs, of sequence 1's own)``."""
    _long_memory(model)
    lengths = [6, 9, 8, 5]
    seqs = _sequences(seed, lengths)
    changed = [s.clone() for s in seqs]
    changed[1] = torch.randint(3, 131, (lengths[1],), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        a, b = (ac.compute_logprobs(model, ac.pack(s)) for s in (seqs, changed))
    cu = _cu(lengths).tolist()
    mine = torch.zeros(sum(lengths), dtype=torch.bool)
    mine[cu[1]:cu[2]] = True
    others = torch.cat([(a.log_probs - b.log_probs)[~mine], (a.entropy - b.entropy)[~mine]]).abs().max().item()
    return others, (a.log_probs - b.log_probs)[mine].abs().max().item()


def _whole_stream(fn):
    """A kernel that ignores the sequence boundaries: one segment over the whole packed stream."""

    def leaky(*args, **kwargs):
        x = args[0]
        args = list(args)
        args[5 if fn is gated_delta_rule_packed else 3] = torch.tensor([0, x.shape[0]], dtype=torch.int32)
        return fn(*args, **kwargs)

    return leaky


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_packing_isolation(model_type):
    # MoE blocks batch each expert's tokens across sequences (a different row count can round differently), so
    # qwen3_next runs with dense MLPs here: its own part is the grouped projection layout.
    overrides = dict(mlp_only_layers=[0, 1]) if model_type == "qwen3_next" else {}
    others, own = _isolation_diffs(build_tiny_model(model_type, **overrides))
    assert others == 0.0, "another sequence's tokens changed this sequence's outputs"
    assert own > TOL["logprob_changed_at_least"]


@pytest.mark.parametrize("broken", ["causal_conv1d_packed", "gated_delta_rule_packed"])
def test_each_boundary_is_needed(monkeypatch, broken):
    """With only the conv's boundary, or only the delta rule's state reset, ignored, sequences leak."""
    import actorcore.kernels.linear_attention.gated_deltanet as mixer  # where the packed mixer calls them

    monkeypatch.setattr(mixer, broken, _whole_stream(getattr(mixer, broken)))
    others, _ = _isolation_diffs(build_tiny_model("qwen3_5_text"))
    assert others > TOL["logprob_changed_at_least"], f"breaking {broken} alone went unnoticed"


# ---- self-checks, copies (activation checkpointing: tests/unit/test_hf_logprobs.py) ----


class _UnpackedForward:
    """Stands in for a transformers version whose layer no longer calls the module's ``forward`` that actorcore
    installed: the module's own computation, given no packing metadata (one stream, no error)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, hidden_states, **kwargs):
        return type(self.module).forward(self.module, hidden_states)


@contextlib.contextmanager
def _bypassing(modules, spec):
    for m in modules:
        m.forward = _UnpackedForward(m)
    yield
    for m in modules:
        del m.forward


def test_bypassed_linear_attention_is_an_error(monkeypatch):
    """A transformers version that bypasses actorcore's linear attention: the trace self-check fires."""
    monkeypatch.setattr("actorcore.hf.features.linear_attention.packed_linear_attention", _bypassing)
    with pytest.raises(PackingNotAppliedError, match="linear attention ran 0 times for 1 linear-attention layers"):
        ac.compute_logprobs(build_tiny_model("qwen3_5_text"), ac.pack(_sequences()))


def test_plain_forward_is_unchanged():
    model = build_tiny_model("qwen3_5_text")
    ids = _sequences()[0][None]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        ac.compute_logprobs(model, ac.pack(_sequences()))
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_installed_forward_follows_a_deep_copy():
    from actorcore.hf.features.linear_attention import install_linear_forwards

    model = build_tiny_model("qwen3_5_text")
    module = model.model.layers[0].linear_attn
    restore = install_linear_forwards([module], get_spec("qwen3_5_text").linear_attention)
    clone = copy.deepcopy(model)
    restore()
    assert "forward" not in module.__dict__
    assert clone.model.layers[0].linear_attn.forward.module is clone.model.layers[0].linear_attn


def test_register_arch_proves_a_real_sized_hybrid_config():
    """``register_arch`` shrinks a Qwen3.5-sized config keeping one layer of each kind, and verify passes."""
    from transformers import AutoConfig

    from actorcore.archs import registry
    from actorcore.hf.register import shrink_config

    big = AutoConfig.for_model("qwen3_5", text_config=dict(num_hidden_layers=8, vocab_size=1000)).text_config
    assert big.layer_types[:3] == ["linear_attention"] * 3
    assert set(shrink_config(big).layer_types) == {"linear_attention", "full_attention"}
    shipped = get_spec("qwen3_5_text")
    try:
        assert ac.register_arch(shipped, big, replace=True).ok
    finally:
        registry().remove("qwen3_5_text", restore=shipped)


def test_sp_size_the_linear_heads_cannot_take_is_refused():
    """4 attention heads / 2 kv heads take sp=4, but 6 linear value heads do not: refused at patch time."""
    from types import SimpleNamespace

    model = build_tiny_model("qwen3_5_text")
    refusal = r"linear-attention .*6 value heads and 2 key heads over sp_size=4.*\[1, 2, 6\]"
    with pytest.raises(ValueError, match=refusal):
        ac.patch_model(model, parallel=SimpleNamespace(sp_size=4, sp_group=object(), sp_rank=0))
    assert "_actorcore_patch" not in model.__dict__ and model.config._attn_implementation == "eager"
    assert "forward" not in model.model.layers[0].linear_attn.__dict__
