"""HF route, one process: packed compute_logprobs / compute_values against an unpatched padded forward,
per token, for every registered text architecture (what does not depend on the architecture, over
``REPRESENTATIVE_ARCHS``)."""

from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.archs import UnsupportedArchitectureError, get_spec, registered_model_types
from actorcore.batch import grid_to_packed, packed_to_grid
from actorcore.errors import PackingNotAppliedError
from actorcore.hf.call import TRACE_KWARG, TraceRef
from actorcore.testing.reference import (
    logprobs_from_logits,
    padded_logits,
    padded_to_packed,
    reference_logprobs,
    right_padded,
)
from actorcore.testing.tiny_configs import REPRESENTATIVE_ARCHS, build_tiny_model, has_critic_class
from actorcore.testing.tolerances import TOL

PACKED = "attention:actorcore_packed"

TEXT_ARCHS = [m for m in registered_model_types() if get_spec(m).vision is None]
LENGTHS = [1, 2, 23, 5, 40, 9]  # very different lengths, including 1 and 2


def _sequences(seed=0, lengths=LENGTHS, vocab=131):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _max_diff(a, b):
    return (a - b).abs().max().item()


def test_unregistered_architecture_is_refused_with_the_list():
    with pytest.raises(UnsupportedArchitectureError, match="registered: .*llama"):
        get_spec("not_a_model")


@pytest.mark.parametrize("model_type", TEXT_ARCHS)
def test_packed_equals_padded_hf_per_token(model_type):
    model = build_tiny_model(model_type)
    seqs = _sequences()
    for left in (False, True):
        ids, mask = right_padded(seqs, left=left)
        batch = ac.pack_padded(ids, mask)
        for temperature in (1.0, 0.7):
            with torch.no_grad():
                out = ac.compute_logprobs(model, batch, temperature=temperature)
                ref_lp, ref_ent = reference_logprobs(model, ids, mask, temperature)
            assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == (sum(LENGTHS),)
            assert _max_diff(out.log_probs, ref_lp) <= TOL["packed_vs_hf_fp32"]
            assert _max_diff(out.entropy, ref_ent) <= TOL["packed_vs_hf_fp32"]
            starts = batch.cu_seqlens[:-1].long()
            assert torch.all(out.log_probs[starts] == 0) and torch.all(out.entropy[starts] == 0)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got, want, tol):
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp(min=1e-30)
        rel = ((got[name] - want[name]).abs().max() / scale).item()
        assert rel <= tol, f"{name}: relative grad difference {rel:.2e}"


@pytest.mark.parametrize("model_type", TEXT_ARCHS)
def test_parameter_gradients_match_padded_hf(model_type):
    model = build_tiny_model(model_type)
    seqs = _sequences(seed=1)
    ids, mask = right_padded(seqs)
    batch = ac.pack_padded(ids, mask)
    g = torch.Generator().manual_seed(2)
    w_lp, w_ent = torch.randn(batch.num_tokens, generator=g), torch.randn(batch.num_tokens, generator=g)

    out = ac.compute_logprobs(model, batch, temperature=0.7)
    ((out.log_probs * w_lp).sum() + (out.entropy * w_ent).sum()).backward()
    packed = _grads(model)
    model.zero_grad(set_to_none=True)

    lp, ent = logprobs_from_logits(padded_logits(model, ids, mask), ids, mask, 0.7)
    lp, ent = padded_to_packed(lp, mask), padded_to_packed(ent, mask)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    spec = get_spec(model_type)
    hybrid_moe = spec.linear_attention is not None and spec.mlp_kind == "moe"  # see the tolerance's comment
    _assert_grads_close(packed, _grads(model), TOL["grad_hybrid_moe_vs_hf_fp32_rel" if hybrid_moe
                                                   else "grad_packed_vs_hf_fp32_rel"])


def test_packed_attention_ran_and_plain_forward_is_unchanged():
    model = build_tiny_model("qwen2")
    ids, mask = right_padded(_sequences())
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        trace = Counter()
        ac.compute_logprobs(model, ac.pack_padded(ids, mask), trace=trace)
        assert trace[PACKED] == model.config.num_hidden_layers
        assert model.config._attn_implementation == "eager"
        plain_trace = Counter()
        after = model(input_ids=ids, attention_mask=mask, **{TRACE_KWARG: TraceRef(plain_trace)}).logits
    assert not plain_trace  # the plain forward does not touch the packed attention
    assert torch.equal(before, after)


def test_bypassed_packed_attention_is_an_error(monkeypatch):
    model = build_tiny_model("llama")
    # Simulate a transformers version that ignores the registered implementation.
    monkeypatch.setattr("actorcore.hf.features.packed_attention.packed_attention",
                        lambda decoder, configs, name: __import__("contextlib").nullcontext())
    with pytest.raises(PackingNotAppliedError, match="bypassed"):
        ac.compute_logprobs(model, ac.pack(_sequences()))


def test_bf16_model_uses_fp32_logits():
    model = build_tiny_model("qwen3", dtype=torch.bfloat16)
    batch = ac.pack(_sequences())
    captured = {}

    def keep_hidden(module, inputs, output):
        captured["hidden"] = output.last_hidden_state[0]

    model.model.register_forward_hook(keep_hidden)
    with torch.no_grad():
        out = ac.compute_logprobs(model, batch)
    hidden, weight = captured["hidden"], model.lm_head.weight
    assert hidden.dtype == torch.bfloat16
    labels = torch.cat([batch.input_ids[1:], batch.input_ids[:1]])
    fp32_logits = hidden.float() @ weight.float().T
    bf16_logits = (hidden @ weight.T).float()

    def scored(logits):
        lp = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
        keep = torch.ones_like(lp, dtype=torch.bool)
        keep[batch.cu_seqlens[1:].long() - 1] = False
        return ac.batch.shift_to_scored_token(torch.where(keep, lp, 0.0))

    err_fused = _max_diff(out.log_probs, scored(fp32_logits))
    err_naive = _max_diff(scored(bf16_logits), scored(fp32_logits))
    assert err_fused <= TOL["fused_head_bf16_vs_fp32_logits"]
    assert err_fused < err_naive


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen3_5_text"])
def test_activation_checkpointing_and_grad_modes(model_type):
    model = build_tiny_model(model_type)
    batch = ac.pack(_sequences(seed=3))
    with torch.no_grad():
        ref = ac.compute_logprobs(model, batch)
    model.train()
    out = ac.compute_logprobs(model, batch)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    for reentrant in (False, True):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        trace = Counter()
        out = ac.compute_logprobs(model, batch, trace=trace)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        # forward + recomputation in backward both ran the packed attention (or, in a hybrid model's
        # linear-attention layers, the packed linear attention)
        assert trace[PACKED] + trace["linear_attention:actorcore_packed"] == 2 * model.config.num_hidden_layers
        assert _max_diff(out.log_probs.detach(), ref.log_probs) <= TOL["packed_vs_hf_fp32"]
        _assert_grads_close(_grads(model), want, TOL["grad_packed_vs_hf_fp32_rel"])
        model.zero_grad(set_to_none=True)


# The critic head is the same for all: the representative architectures that transformers gives a critic class.
@pytest.mark.parametrize("model_type", [m for m in sorted(REPRESENTATIVE_ARCHS) if has_critic_class(m)])
def test_values_equal_padded_critic(model_type):
    critic = build_tiny_model(model_type, task="token_classification")
    ids, mask = right_padded(_sequences(seed=4), left=True)
    with torch.no_grad():
        values = ac.compute_values(critic, ac.pack_padded(ids, mask))
        ref = padded_logits(critic, ids, mask)[..., 0].float()
    assert values.dtype == torch.float32
    assert _max_diff(values, padded_to_packed(ref, mask)) <= TOL["packed_vs_hf_fp32"]


def test_values_need_a_critic():
    with pytest.raises(ValueError, match="1-output 'score' head"):
        ac.compute_values(build_tiny_model("llama"), ac.pack(_sequences()))


def test_entropy_can_be_skipped():
    out = ac.compute_logprobs(build_tiny_model("llama"), ac.pack(_sequences()), entropy=False)
    assert out.entropy is None


@pytest.mark.parametrize("temperature", [0, -1.0, "1"])
def test_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        ac.compute_logprobs(build_tiny_model("llama"), ac.pack(_sequences()), temperature=temperature)


def test_bad_batch_and_out_of_vocab_ids():
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match="PackedBatch"):
        ac.compute_logprobs(model, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="vocabulary has 131"):
        ac.compute_logprobs(model, ac.pack([torch.tensor([1, 500])]))


def test_bf16_model_gradients_track_fp32_model():
    """Actor update in bf16: gradients exist in bf16 and follow the fp32 model's within bf16 rounding."""
    fp32 = build_tiny_model("llama")
    bf16 = build_tiny_model("llama", dtype=torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    fp32.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in fp32.state_dict().items()})
    batch = ac.pack(_sequences(seed=6))
    for model in (fp32, bf16):
        out = ac.compute_logprobs(model, batch)
        assert out.log_probs.dtype == torch.float32
        (out.log_probs.sum() + out.entropy.sum()).backward()
    for (name, p32), p16 in zip(fp32.named_parameters(), bf16.parameters()):
        assert p16.grad.dtype == torch.bfloat16 and torch.isfinite(p16.grad).all()
        rel = ((p16.grad.float() - p32.grad).norm() / p32.grad.norm()).item()
        assert rel < TOL["grad_bf16_vs_fp32_rel_norm"], f"{name}: bf16 gradient off by {rel:.2e} (relative norm)"


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_wrapper_recomputes_with_packed_attention(reentrant):
    """Layers wrapped by torch's checkpoint_wrapper (as FSDP2 recipes do) recompute under the packed switch."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = build_tiny_model("qwen3")
    batch = ac.pack(_sequences(seed=7))
    out = ac.compute_logprobs(model, batch)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=impl)
    model.train()
    trace = Counter()
    out = ac.compute_logprobs(model, batch, trace=trace)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert trace[PACKED] == 2 * model.config.num_hidden_layers
    got = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in _grads(model).items()}
    _assert_grads_close(got, want, TOL["grad_packed_vs_hf_fp32_rel"])


def test_switch_that_does_not_read_back_is_an_error_and_leaves_nothing_changed():
    """If a transformers version stores the implementation elsewhere, switching fails loudly, not silently."""
    from actorcore.hf.features.attention import swap_attention_implementation

    class StoresElsewhere:
        _attn_implementation = "eager"  # a class attribute: writing the instance dict does not change it

    config = StoresElsewhere()
    with pytest.raises(PackingNotAppliedError, match="does not read back"):
        swap_attention_implementation([config], "actorcore_packed")
    assert config.__dict__ == {}


def test_misspelt_keywords_are_refused():
    """``temprature=0.7`` must not run at temperature 1.0 without a word."""  # codespell:ignore temprature
    model = build_tiny_model("llama")
    batch = ac.pack(_sequences())
    for call in (lambda: ac.compute_logprobs(model, batch, temprature=0.7),  # codespell:ignore temprature
                 lambda: ac.compute_values(model, batch, paralel=None),  # codespell:ignore paralel
                 lambda: ac.compute_loss(model, batch, lambda lp, ent: -lp, temprature=0.7)):  # codespell:ignore
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            call()


def test_check_finite_names_the_first_non_finite_layer():
    from actorcore.errors import NonFiniteError

    model = build_tiny_model("llama")
    batch = ac.pack(_sequences())
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        assert torch.isnan(ac.compute_logprobs(model, batch).log_probs).any()  # plain transformers does the same
        with pytest.raises(NonFiniteError, match="decoder layer 1 "):
            ac.compute_logprobs(model, batch, check_finite=True)
        with pytest.raises(NonFiniteError, match="decoder layer 1 "):
            ac.compute_loss(model, batch, lambda lp, ent: -lp, check_finite=True)


def test_non_callable_loss_fn_is_refused_before_the_forward():
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match="loss_fn must be a callable"):
        ac.compute_loss(model, ac.pack(_sequences()), "ppo")


def test_attention_sinks_are_applied():
    """gpt-oss's per-head sink logits join every softmax denominator: with large sinks the packed path still
    equals the model's own forward, and dropping the sinks would change the result (so they were applied)."""
    model = build_tiny_model("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
    seqs = _sequences(seed=5)
    ids, mask = right_padded(seqs)
    trace = Counter()
    with torch.no_grad():
        out = ac.compute_logprobs(model, ac.pack(seqs), trace=trace)
        ref_lp, ref_ent = reference_logprobs(model, ids, mask)
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: as if there were no sinks
        without = ac.compute_logprobs(model, ac.pack(seqs))
    assert _max_diff(out.log_probs, ref_lp) <= TOL["packed_vs_hf_fp32"]
    assert _max_diff(out.entropy, ref_ent) <= TOL["packed_vs_hf_fp32"]
    assert _max_diff(out.log_probs, without.log_probs) > TOL["logprob_changed_at_least"]
    assert trace["varlen_attention:segments"] == model.config.num_hidden_layers  # the backend that applies sinks


@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVE_ARCHS))  # every kind of attention and MLP
def test_packing_isolation_is_bitwise(model_type):
    """Changing one sequence's tokens leaves every other sequence's outputs bitwise unchanged."""
    model = build_tiny_model(model_type)
    seqs = _sequences(seed=11)
    changed = [s.clone() for s in seqs]
    changed[2] = torch.randint(3, 131, changed[2].shape, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        a, b = (ac.compute_logprobs(model, ac.pack(s), temperature=0.8) for s in (seqs, changed))
    bounds = ac.pack(seqs).cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        same_lp, same_ent = (torch.equal(x[start:end], y[start:end]) for x, y in
                             ((a.log_probs, b.log_probs), (a.entropy, b.entropy)))
        assert (same_lp and same_ent) == (i != 2), f"sequence {i}"


@pytest.mark.parametrize("left", [False, True])
def test_padded_call_returns_the_input_grid(left):
    """TRL-style [B, S] in and out: per token equal to the padded HF forward, in the input's own layout."""
    model = build_tiny_model("qwen3")
    ids, mask = right_padded(_sequences(seed=8), left=left)
    with torch.no_grad():
        out = ac.compute_logprobs_padded(model, ids, mask, temperature=0.9)
        ref_lp, ref_ent = logprobs_from_logits(padded_logits(model, ids, mask), ids, mask, temperature=0.9)
    assert out.log_probs.shape == ids.shape and out.entropy.shape == ids.shape
    assert _max_diff(out.log_probs, ref_lp) <= TOL["packed_vs_hf_fp32"]
    assert _max_diff(out.entropy, ref_ent) <= TOL["packed_vs_hf_fp32"]
    assert torch.equal(out.log_probs[mask == 0], torch.zeros(int((mask == 0).sum())))
    # grid <-> packed round trip for per-token arguments (advantages held as [B, S])
    adv_BS = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0)) * mask
    adv_T = grid_to_packed(adv_BS, mask)
    assert adv_T.shape == (int(mask.sum()),) and torch.equal(packed_to_grid(adv_T, mask), adv_BS)
    loss = ac.compute_loss(model, ac.pack_padded(ids, mask), lambda lp, ent, a: -lp * a, token_args=(adv_T,),
                           temperature=0.9)
    assert _max_diff(packed_to_grid(loss.logprob, mask), out.log_probs) <= TOL["packed_vs_hf_fp32"]


def test_untested_transformers_is_refused_with_what_to_install():
    from actorcore.hf.features.attention import check_transformers_version

    for ok in ("5.10.0", "5.17.0", "5.24.1", "5.30.0.dev0"):
        check_transformers_version(ok)
    for bad in ("4.57.1", "5.5.0", "6.0.0"):
        with pytest.raises(ImportError, match=r"needs transformers>=5.10,<6 .* found " + bad.replace(".", r"\.")):
            check_transformers_version(bad)
