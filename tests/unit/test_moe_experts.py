"""The MoE experts path (``patch_model(moe_experts="sorted")``, ``hf.features.moe_experts``), forced on the CPU in
fp32: per token and per gradient element (every parameter: experts, routers, embeddings) against the model's own
forward with transformers' eager experts, one sequence at a time, for every registered MoE architecture with
transformers' standard experts class; the gather-only ``permute`` / ``combine`` / ``expert_bias`` Functions against
plain torch indexing (float64, and ``gradcheck``); two runs bitwise equal; router logits as the model's own; the
recomputation of checkpointed layers runs the path too; the trace proves it ran (a bypassed path raises, naming
why); the model's own forward keeps its own experts code, and so does another model built from the same config object;
``revert``, ``copy.deepcopy`` and ``torch.load`` in a fresh process; the option's values and
refusals; the experts forward traced by ``torch.compile(dynamic=True)`` without a graph break, and compiled in the
compiled decoder on the CPU."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections import Counter

import pytest
import torch

import actorcore as ac
import actorcore.hf.features.compiled_decoder as compiled_decoder
from actorcore.archs import spec_for_model
from actorcore.errors import PatchNotAppliedError
from actorcore.hf.features.compiled_decoder import COMPILED_TRACE_KEY
import actorcore.hf.features.moe_experts as moe_experts
import actorcore.kernels.quack.runtime as quack_runtime
from actorcore.hf.features.class_paths import TRACE_ATTR
from actorcore.hf.features.moe_experts import EXPERTS_FUNCTIONS, MOE_EXPERTS_KEY, OWN_CONFIG_ATTR, sorted_experts_forward
from actorcore.kernels.moe_permute import combine, expert_bias, permute, sort_by_expert
from actorcore.testing.tiny_configs import build_tiny_model, checkpointed
from actorcore.testing.tolerances import TOL


# Every registered text MoE architecture (the VLMs share these experts classes: see test_vlm_moe_experts_found).
COVERED = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3", "qwen3_next",
           "qwen3_5_moe_text")
LENGTHS = (7, 19, 1, 12)
TEMPERATURE = 0.9


def _sequences(seed=0, vocab=131):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]


def _weights(n):
    return torch.linspace(0.5, 1.5, n)


def _loss(log_probs, entropy):
    return -(log_probs * _weights(log_probs.numel())).sum() - 0.1 * entropy.sum()


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _own_forward_step(model, sequences):
    """The model's own forward, one sequence at a time: fp32 log-probs and entropies of the next token, the loss's
    parameter gradients."""
    log_probs, entropies = [], []
    for ids in sequences:
        logp = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0].float() / TEMPERATURE, -1)
        log_probs.append(torch.cat([logp.new_zeros(1), logp[:-1].gather(-1, ids[1:, None])[:, 0]]))
        entropies.append(torch.cat([logp.new_zeros(1), -(logp[:-1].exp() * logp[:-1]).sum(-1)]))
    lp, ent = torch.cat(log_probs), torch.cat(entropies)
    _loss(lp, ent).backward()
    return lp.detach(), ent.detach(), _grads(model)


def _actorcore_step(model, sequences, trace):
    out = ac.compute_logprobs(model, ac.pack(sequences), temperature=TEMPERATURE, trace=trace)
    _loss(out.log_probs, out.entropy).backward()
    return out.log_probs.detach(), out.entropy.detach(), _grads(model)


def _assert_close(want, got, lp_tol, grad_tol):
    (lp_w, ent_w, g_w), (lp_g, ent_g, g_g) = want, got
    assert (lp_w - lp_g).abs().max().item() < lp_tol and (ent_w - ent_g).abs().max().item() < lp_tol
    assert g_w.keys() == g_g.keys()
    for name in g_w:
        scale = g_w[name].abs().max().item()
        assert (g_w[name] - g_g[name]).abs().max().item() <= grad_tol * scale, name


def _assert_bitwise(a, b):
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = a, b
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b) and g_a.keys() == g_b.keys()
    for name in g_a:
        assert torch.equal(g_a[name], g_b[name]), name


def _moe_model(model_type, seed=1, **overrides):
    model = build_tiny_model(model_type, seed=seed, **overrides).train()
    model.set_experts_implementation("eager")  # the reference: transformers' per-expert loop
    return model


def _grad_tolerance(model):
    """Parameter gradients vs the model's own forward, relative to the max magnitude (the hybrids' decay parameters
    sum over the recurrence)."""
    hybrid = spec_for_model(model).linear_attention is not None
    return TOL["grad_hybrid_moe_vs_hf_fp32_rel" if hybrid else "grad_packed_vs_hf_fp32_rel"]


def _experts(model, handle):
    return [model.model.get_submodule(name) for name in handle.state.targets("moe_experts")]


def _on_path(module, kernel="sorted"):
    """Whether the experts module runs actorcore's function (its config copy names it) holding a trace slot."""
    return module.config._experts_implementation == EXPERTS_FUNCTIONS[kernel] and TRACE_ATTR in module.__dict__


def _counting(monkeypatch):
    """The experts modules that run the path, in order."""
    runs = []

    def counted(experts, *args):
        runs.append(experts)
        return sorted_experts_forward(experts, *args)

    monkeypatch.setattr(moe_experts, "sorted_experts_forward", counted)
    return runs


# --- the Functions against plain torch indexing ------------------------------------------------------------------

def _plain_moe_moves(x, rows_fn, weights, top_k_index):
    """Plain indexing (as transformers' grouped forward moves tokens): sorted rows, ``rows_fn``, unsorted, summed."""
    num_tokens, top_k = top_k_index.shape
    perm = torch.sort(top_k_index.reshape(-1), stable=True).indices
    rows = rows_fn(x[perm // top_k], top_k_index.reshape(-1)[perm])
    inverse = torch.argsort(perm)
    weighted = rows[inverse].view(num_tokens, top_k, -1) * weights[..., None]
    return weighted.sum(1)


def _routing(num_tokens, top_k, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    index[:3] = index[0].clone()  # tokens routed alike (ties in the sort)
    return index


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(9, 2, 4), (13, 3, 7), (1, 1, 3)])
def test_sort_permute_combine_match_plain_indexing_fp64(num_tokens, top_k, num_experts):
    torch.manual_seed(num_tokens)
    index = _routing(num_tokens, top_k, num_experts, seed=num_tokens)
    order = sort_by_expert(index, num_experts)
    counts = torch.bincount(index.reshape(-1), minlength=num_experts)
    assert torch.equal(order.offsets, counts.cumsum(0).to(torch.int32))
    assert torch.equal(order.expert_of_row, index.reshape(-1)[order.pair_of_row])
    assert torch.equal(order.pair_of_row.reshape(-1)[order.row_of_pair.reshape(-1)], torch.arange(index.numel()))
    for e in range(num_experts):  # stable: within an expert, in token order
        pairs = order.pair_of_row[order.expert_of_row == e]
        assert torch.equal(pairs, pairs.sort().values)

    dims = 6
    x = torch.randn(num_tokens, dims, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(num_tokens, top_k, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(num_experts, dims, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(dims, dtype=torch.float64)

    def rows_fn(rows, experts):  # something per row and expert, with a bias of its expert
        return torch.tanh(rows * scale) + bias[experts]

    want = _plain_moe_moves(x, rows_fn, weights, index)
    rows = permute(x, order)
    got = combine(torch.tanh(rows * scale) + expert_bias(bias, order), weights, order, torch.float64)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (x, weights, bias), grad)
    got_grads = torch.autograd.grad(got, (x, weights, bias), grad)
    tol = TOL["moe_moves_fp64_vs_plain"]
    assert (want - got).abs().max().item() < tol
    for w, g in zip(want_grads, got_grads):
        assert (w - g).abs().max().item() < tol


def test_functions_pass_gradcheck():
    index = _routing(5, 2, 3, seed=3)
    order = sort_by_expert(index, 3)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    opts = dict(eps=TOL["gradcheck_fp64"], atol=TOL["gradcheck_fp64"])
    assert torch.autograd.gradcheck(lambda t: permute(t, order), (x,), **opts)
    assert torch.autograd.gradcheck(lambda r, w: combine(r, w, order, torch.float64), (rows, weights), **opts)
    assert torch.autograd.gradcheck(lambda b: expert_bias(b, order), (bias,), **opts)


def test_combine_rounds_once_from_fp32():
    index = _routing(8, 3, 4, seed=5)
    order = sort_by_expert(index, 4)
    rows = torch.randn(24, 16).to(torch.bfloat16)
    weights = torch.rand(8, 3).to(torch.bfloat16)
    want = (rows.double()[order.row_of_pair] * weights.double()[..., None]).sum(1).to(torch.bfloat16)
    assert torch.equal(combine(rows, weights, order, torch.bfloat16), want)


# --- the path in models against their own forward ----------------------------------------------------------------

@pytest.mark.parametrize("model_type", COVERED)
def test_matches_the_models_own_forward_and_ran(model_type):
    model = _moe_model(model_type)
    sequences = _sequences()
    want = _own_forward_step(model, sequences)
    handle = ac.patch_model(model, moe_experts="sorted")
    experts = _experts(model, handle)
    assert experts and all(_on_path(m) for m in experts)
    # one config copy for all layers (one compiled layer serves them); the model's own config untouched
    assert len({id(m.config) for m in experts}) == 1 and experts[0].config is not model.config
    assert getattr(experts[0].config, OWN_CONFIG_ATTR) is model.config
    assert model.config._experts_implementation == "eager"
    trace = Counter()
    got = _actorcore_step(model, sequences, trace)
    assert trace[MOE_EXPERTS_KEY] == len(experts)
    assert any(n.startswith("model.embed_tokens") for n in got[2])
    assert sum(".experts." in n for n in got[2]) >= 2 * len(experts)
    _assert_close(want, got, TOL["packed_vs_hf_fp32"], _grad_tolerance(model))
    _assert_bitwise(got, _actorcore_step(model, sequences, Counter()))  # deterministic
    handle.revert()
    assert all(m.config is model.config and TRACE_ATTR not in m.__dict__ for m in experts)


def test_checkpointed_layers_recompute_on_the_path(monkeypatch):
    model = checkpointed(_moe_model("qwen2_moe"))
    sequences = _sequences(1)
    handle = ac.patch_model(model, moe_experts="sorted")
    plain = _actorcore_step(model, sequences, Counter())
    handle.revert()
    runs = []

    def counting(*args):  # the forward and its recomputation in backward
        runs.append(1)
        return sorted_experts_forward(*args)

    monkeypatch.setattr(moe_experts, "sorted_experts_forward", counting)
    for mode in ("full", "selective"):
        runs.clear()
        handle = ac.patch_model(model, moe_experts="sorted", checkpointing=mode)
        got = _actorcore_step(model, sequences, Counter())
        assert len(runs) == 2 * len(handle.state.targets("moe_experts")), mode
        _assert_close(plain, got, TOL["packed_vs_hf_fp32"], _grad_tolerance(model))
        handle.revert()


def test_router_logits_are_the_models_own():
    model = _moe_model("mixtral")  # every layer MoE: the second router reads the first layer's experts' output
    sequences = _sequences(2)
    routers = [layer.mlp.gate for layer in model.model.layers]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[0].detach().clone()))
             for i, r in enumerate(routers)]
    with torch.no_grad():
        for ids in sequences:
            model(input_ids=ids[None], use_cache=False)
        want = [torch.cat(s) for s in seen]
        for s in seen:
            s.clear()
        handle = ac.patch_model(model, moe_experts="sorted")
        ac.compute_logprobs(model, ac.pack(sequences))
    got = [torch.cat(s) for s in seen]
    for h in hooks:
        h.remove()
    handle.revert()
    for w, g in zip(want, got):
        assert w.shape == g.shape and (w - g).abs().max().item() < TOL["packed_vs_hf_fp32"]


def test_own_forward_bypassed_path_deepcopy_and_revert(monkeypatch):
    model = _moe_model("qwen2_moe")
    sequences = _sequences(3)
    handle = ac.patch_model(model, moe_experts="sorted")
    runs = _counting(monkeypatch)
    with torch.no_grad():
        model(input_ids=sequences[0][None])  # the model's own forward: its own experts code
    assert not runs

    twin = copy.deepcopy(model)
    twin_experts = [twin.model.get_submodule(n) for n in handle.state.targets("moe_experts")]
    assert all(_on_path(m) for m in twin_experts)
    assert getattr(twin_experts[0].config, OWN_CONFIG_ATTR) is twin.config  # the copy's own config, one copy
    assert len({id(m.config) for m in twin_experts}) == 1 and twin_experts[0].config is not _experts(model, handle)[0].config
    with torch.no_grad():
        twin_experts[0].down_proj.mul_(2.0)  # the copy computes with its own weights
        trace = Counter()
        twin_lp = ac.compute_logprobs(twin, ac.pack(sequences), trace=trace).log_probs
        assert trace[MOE_EXPERTS_KEY] == len(twin_experts)
        assert [id(m) for m in runs] == [id(m) for m in twin_experts]  # the copy's modules, not the original's
        twin_experts[0].down_proj.div_(2.0)
        twin_own = ac.compute_logprobs(twin, ac.pack(sequences)).log_probs
        assert (twin_lp - twin_own).abs().max().item() > TOL["logprob_changed_at_least"]
        assert torch.equal(twin_own, ac.compute_logprobs(model, ac.pack(sequences)).log_probs)

    bypassed = model.model.get_submodule(handle.state.targets("moe_experts")[0])
    installed = bypassed.config
    bypassed.config = model.config  # as if another patch had given the module its config back
    with pytest.raises(PatchNotAppliedError, match=r"MoE experts path ran in 1 of 2 experts modules of .*"
                                                   r"layers.0.mlp.experts: Qwen2MoeExperts's config names the experts "
                                                   r"implementation 'eager', not 'actorcore_sorted'"):
        ac.compute_logprobs(model, ac.pack(sequences))
    bypassed.config = installed
    monkeypatch.setattr(bypassed, "forward", lambda *a: type(bypassed).forward.__wrapped__(bypassed, *a))  # eager
    with pytest.raises(PatchNotAppliedError, match=r"ran in 1 of 2 .*forward no longer dispatches through "
                                                   r"transformers' ExpertsInterface"):
        ac.compute_logprobs(model, ac.pack(sequences))
    monkeypatch.delattr(bypassed, "forward")
    installed._experts_implementation = "grouped_mm"  # the copy's setting, shared by the layers: none ran it
    with pytest.raises(PatchNotAppliedError, match=r"ran in 0 of 2 .*names the experts implementation 'grouped_mm'"):
        ac.compute_logprobs(model, ac.pack(sequences))
    installed._experts_implementation = "actorcore_sorted"
    handle.revert()
    assert all(m.config is model.config and TRACE_ATTR not in m.__dict__ for m in _experts(model, handle))


def test_a_model_sharing_the_config_keeps_its_own_experts(monkeypatch):
    """Two models built from one config object (an actor and its reference model): patching one names actorcore's
    function on its own modules' config copy only; the other's forward is unchanged and its experts run their own
    code, in its own forward and in actorcore's calls; reverting one patch leaves the other's in force."""
    model = _moe_model("qwen3_moe")
    other = type(model)(model.config).train()
    other.load_state_dict(model.state_dict())
    assert other.config is model.config
    sequences = _sequences(7)
    with torch.no_grad():
        want = other(input_ids=sequences[1][None], use_cache=False).logits
    runs = _counting(monkeypatch)
    handle = ac.patch_model(model, moe_experts="sorted")
    other_experts = [other.model.get_submodule(n) for n in handle.state.targets("moe_experts")]
    assert model.config._experts_implementation == "eager" and all(m.config is model.config for m in other_experts)
    with torch.no_grad():
        assert torch.equal(other(input_ids=sequences[1][None], use_cache=False).logits, want)
        trace = Counter()
        ac.compute_logprobs(other, ac.pack(sequences), trace=trace)
    assert not runs and trace[MOE_EXPERTS_KEY] == 0

    other_handle = ac.patch_model(other, moe_experts="sorted")
    handle.revert()  # the first model's revert: the other's patch stays
    with torch.no_grad():
        trace = Counter()
        ac.compute_logprobs(other, ac.pack(sequences), trace=trace)
        assert trace[MOE_EXPERTS_KEY] == len(other_experts) and [id(m) for m in runs] == [id(m) for m in other_experts]
        runs.clear()
        model(input_ids=sequences[1][None], use_cache=False)
        other(input_ids=sequences[1][None], use_cache=False)
    assert not runs  # the model's own forwards: their own experts code

    # transformers' setter after the patch sets the models' configs, not the modules' copy: it decides the model's
    # own forward (read at each call); actorcore's calls keep the path
    spied = []
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    batched = ALL_EXPERTS_FUNCTIONS["batched_mm"]
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "batched_mm", lambda m, *a: spied.append(m) or batched(m, *a))
    other.set_experts_implementation("batched_mm")
    with torch.no_grad():
        other(input_ids=sequences[1][None], use_cache=False)
        assert [id(m) for m in spied] == [id(m) for m in other_experts] and not runs
        spied.clear()
        trace = Counter()
        ac.compute_logprobs(other, ac.pack(sequences), trace=trace)
    assert trace[MOE_EXPERTS_KEY] == len(other_experts) and not spied
    other_handle.revert()
    assert all(m.config is model.config and TRACE_ATTR not in m.__dict__ for m in other_experts)


def test_torch_load_in_a_fresh_process_keeps_the_path(tmp_path):
    """Unpickling a patched model imports actorcore (its patch state's classes), which registers the experts
    functions: the loaded model's own forward and actorcore's calls run as before the save."""
    model = _moe_model("qwen3_moe")
    handle = ac.patch_model(model, moe_experts="sorted")
    sequences = _sequences(8)
    with torch.no_grad():
        own = model(input_ids=sequences[0][None], use_cache=False).logits
        want = ac.compute_logprobs(model, ac.pack(sequences)).log_probs
    modules = len(handle.state.targets("moe_experts"))
    torch.save({"model": model, "sequences": sequences, "own": own, "want": want, "modules": modules},
               tmp_path / "patched.pt")
    handle.revert()
    code = ("import sys, torch; saved = torch.load(sys.argv[1], weights_only=False); model = saved['model']\n"
            "assert 'actorcore.hf.features.moe_experts' in sys.modules\n"
            "with torch.no_grad(): own = model(input_ids=saved['sequences'][0][None], use_cache=False).logits\n"
            "assert torch.equal(own, saved['own'])\n"
            "import actorcore as ac; from collections import Counter; trace = Counter()\n"
            "with torch.no_grad(): got = ac.compute_logprobs(model, ac.pack(saved['sequences']), trace=trace).log_probs\n"
            "assert torch.equal(got, saved['want']) and trace['moe_experts:modules'] == saved['modules'], trace\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "patched.pt")], check=True)


# --- the option ------------------------------------------------------------------------------------------------

def test_quack_runs_its_experts_function_on_the_stand_in():
    """``moe_experts="quack"`` (quack's GEMMs as the CPU stand-in, bf16): the experts' config copy names
    ``actorcore_quack``, every experts module runs it in the call, and the log-probs per token and every gradient
    are within bf16 rounding of ``moe_experts="sorted"``; the model's own forward keeps its own experts code."""
    from actorcore.testing.quack_stand_in import use_quack_stand_in

    sequences = _sequences()
    undo = use_quack_stand_in()
    try:
        runs = {}
        for kernel in ("quack", "sorted"):
            model = _moe_model("qwen3_moe").to(torch.bfloat16)
            with torch.no_grad():
                before = model(input_ids=sequences[0][None], use_cache=False).logits
            handle = ac.patch_model(model, moe_experts=kernel)
            experts = _experts(model, handle)
            assert {m.config._experts_implementation for m in experts} == {f"actorcore_{kernel}"}
            trace = Counter()
            runs[kernel] = _actorcore_step(model, sequences, trace)
            assert trace[MOE_EXPERTS_KEY] == len(experts), kernel
            with torch.no_grad():  # not an actorcore call: the model's own experts code, bitwise
                assert torch.equal(model(input_ids=sequences[0][None], use_cache=False).logits, before)
            handle.revert()
    finally:
        undo()
    (lp, ent, grads), (want_lp, want_ent, want_grads) = runs["quack"], runs["sorted"]
    tol = TOL["quack_experts_vs_grouped_bf16"]
    torch.testing.assert_close(lp, want_lp, atol=tol, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=tol, rtol=0)
    assert sorted(grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        diff = (grads[name].float() - grad.float()).norm()
        assert diff <= TOL["grad_quack_experts_vs_grouped_bf16_rel_norm"] * grad.float().norm(), name


@pytest.mark.parametrize("value", [True, "yes", "Grouped", 1, None, 0])
def test_bad_values_are_refused(value):
    model = _moe_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"moe_experts must be 'auto', 'sorted', 'quack' or False"):
        ac.patch_model(model, moe_experts=value)
    assert not ac.hf.patch.is_patched(model)


def test_misspelt_keyword_is_an_error():
    with pytest.raises(TypeError):
        ac.patch_model(_moe_model("qwen3_moe"), moe_expert="sorted")


def test_auto_takes_the_path_where_the_decoder_is_fused(monkeypatch):
    """``"auto"`` (the default) installs the path where the decoder is compiled (on the GPU; here the compiled decoder's
    refusal is lifted to show the choice), and keeps the model's own experts code elsewhere, saying why in the
    plan; the GPU case: tests/gpu/test_moe_experts_cuda.py."""
    model = _moe_model("qwen3_moe")
    handle = ac.patch_model(model)  # the CPU: no compiled decoder, the model's own experts
    assert handle.state.targets("moe_experts") == () and "the decoder is not compiled here" in handle.plan["moe_experts"].why
    assert not _on_path(model.model.layers[0].mlp.experts)
    handle.revert()
    assert ac.patch_model(build_tiny_model("llama"), moe_experts="auto").state.targets("moe_experts") == ()

    import actorcore.hf.features.compiled_decoder as compiled_decoder

    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    handle = ac.patch_model(model)
    assert handle.state.targets("compiled_decoder") and handle.state.targets("moe_experts") == ("layers.0.mlp.experts",)
    assert _on_path(model.model.layers[0].mlp.experts)
    handle.revert()
    handle = ac.patch_model(model, compiled_decoder=False)  # eager decoder: the model's own experts
    assert handle.state.targets("moe_experts") == ()
    handle.revert()
    import actorcore.hf.features.moe_experts as moe_experts

    quack_refusal_for = moe_experts._quack_refusal_for
    monkeypatch.setattr(moe_experts, "_quack_refusal_for", lambda modules: None)  # as if quack ran here
    for hybrid in ("qwen3_next", "qwen3_5_moe_text"):  # linear-attention layers: as any MoE model
        next_model = _moe_model(hybrid)
        handle = ac.patch_model(next_model)
        assert handle.state.targets("compiled_decoder") and handle.state.targets("moe_experts")
        choice = handle.plan["moe_experts"]
        assert choice.value == "quack" and "quack's GEMMs run here" in choice.why, choice.line()
        handle.revert()
    monkeypatch.setattr(moe_experts, "_quack_refusal_for", quack_refusal_for)
    model.model.layers[0].mlp.experts._is_expert_parallel = True  # a model the path refuses: "auto" keeps its code
    handle = ac.patch_model(model)
    assert handle.state.targets("moe_experts") == () and "expert-parallel" in str(handle.plan)
    handle.revert()


def test_grouped_refusals():
    with pytest.raises(ValueError, match=r"llama has no MoE layers"):
        ac.patch_model(build_tiny_model("llama"), moe_experts="sorted")
    model = _moe_model("qwen2_moe")
    experts = model.model.layers[1].mlp.experts
    experts._is_expert_parallel = True
    with pytest.raises(ValueError, match=r"expert-parallel"):
        ac.patch_model(model, moe_experts="sorted")
    assert ac.patch_model(model).state.targets("moe_experts") == ()  # "auto": the model's own code, no error
    model = _moe_model("qwen2_moe")
    model.model.layers[0].mlp.experts.__dict__["forward"] = lambda *a: None
    with pytest.raises(ValueError, match=r"already has an instance forward"):
        ac.patch_model(model, moe_experts="sorted")
    assert not _on_path(model.model.layers[1].mlp.experts)  # nothing stayed installed

    model = _moe_model("qwen3_moe")
    custom = type("CustomExperts", (type(model.model.layers[0].mlp.experts),),
                  {"forward": lambda self, h, i, w: torch.zeros_like(h)})
    model.model.layers[0].mlp.experts.__class__ = custom
    with pytest.raises(ValueError, match=r"CustomExperts is not transformers' standard experts class"):
        ac.patch_model(model, moe_experts="sorted")
    model = _moe_model("qwen3_moe").double()
    with pytest.raises(ValueError, match=r"torch.float64"):
        ac.patch_model(model, moe_experts="sorted")
    model = _moe_model("qwen3_moe")
    model._tp_size = 2  # as transformers' tp_plan loading records it
    with pytest.raises(ValueError, match=r"tensor-parallel through transformers' tp_plan"):
        ac.patch_model(model, moe_experts="sorted")


def test_quack_refusals():
    """``moe_experts="quack"`` refuses with the reason where its fused GEMMs cannot run (here: no Hopper GPU) and
    for experts whose MLP is not a concatenated SiLU-gated one without biases; nothing stays installed."""
    from actorcore.hf.features.moe_experts import quack_module_refusal

    model = _moe_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"moe_experts='quack': .*(Hopper|not installed).* or 'sorted'"):
        ac.patch_model(model, moe_experts="quack")
    assert not ac.hf.patch.is_patched(model) and not _on_path(model.model.layers[0].mlp.experts)
    assert "no concatenated [gate; up]" in quack_module_refusal(_moe_model("gpt_oss").model.layers[0].mlp.experts)
    module = _moe_model("qwen3_moe").model.layers[0].mlp.experts
    module.has_bias = True
    assert "has biases" in quack_module_refusal(module)
    module = _moe_model("qwen3_moe").model.layers[0].mlp.experts
    assert "not a 16-bit CUDA module" in quack_module_refusal(module)  # the math is covered, the device is not
    module.act_fn = torch.nn.GELU()
    assert "not SiLU" in quack_module_refusal(module)


def test_auto_takes_quack_where_it_runs_and_covers_the_model(monkeypatch):
    """``"auto"`` runs the path with quack's kernels where ``quack_refusal`` and every installed module's
    ``quack_module_refusal`` pass (here faked: the CPU has no Hopper GPU), the grouped kernels where either refuses;
    ``"sorted"`` stays on the sorted path."""
    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)  # as on CUDA: "auto" installs the path
    monkeypatch.setattr(quack_runtime, "quack_refusal", lambda: None)
    monkeypatch.setattr(moe_experts, "quack_module_refusal", lambda module: None)
    model = _moe_model("qwen3_moe")
    for request, kernel in (("auto", "quack"), ("sorted", "sorted")):
        handle = ac.patch_model(model, moe_experts=request)
        assert handle.state.targets("moe_experts") and handle.state.value("moe_experts") == kernel
        assert all(_on_path(m, kernel) for m in _experts(model, handle))
        handle.revert()
    monkeypatch.setattr(moe_experts, "quack_module_refusal", lambda module: "Experts has biases")
    handle = ac.patch_model(model)
    assert handle.state.targets("moe_experts") and handle.state.value("moe_experts") == "sorted"
    handle.revert()
    monkeypatch.setattr(quack_runtime, "quack_refusal", lambda: "not installed")
    monkeypatch.setattr(moe_experts, "quack_module_refusal", lambda module: None)
    handle = ac.patch_model(model)
    assert handle.state.value("moe_experts") == "sorted"
    handle.revert()


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "glm4v_moe", "qwen3_5_moe", "kimi_k25"])
def test_vlm_language_models_take_the_path(model_type):
    from actorcore.testing.tiny_vlm import TEXT_VOCAB, build_tiny_vlm

    model = build_tiny_vlm(model_type, seed=1).train()
    model.set_experts_implementation("eager")
    sequences = _sequences(4, vocab=TEXT_VOCAB)  # text only: the language model's experts are what is tested
    want = _own_forward_step(model, sequences)
    handle = ac.patch_model(model, moe_experts="sorted")
    assert handle.state.targets("moe_experts")
    trace = Counter()
    got = _actorcore_step(model, sequences, trace)
    assert trace[MOE_EXPERTS_KEY] == len(handle.state.targets("moe_experts"))
    _assert_close(want, got, TOL["packed_vs_hf_fp32"], _grad_tolerance(model))
    handle.revert()


# --- torch.compile ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_forward_traces_without_graph_breaks(dtype):
    model = _moe_model("gpt_oss", dtype=dtype)  # biases, transposed weights, its own clamped gate
    handle = ac.patch_model(model, moe_experts="sorted")
    experts = _experts(model, handle)[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 64, generator=g).to(dtype).requires_grad_(True)
    index = _routing(11, 2, 4, seed=6)
    weights = torch.rand(11, 2, generator=g).to(dtype).requires_grad_(True)
    handle.state.trace.counts = Counter()  # as inside an actorcore call
    try:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda *a: experts(*a))(x, index, weights)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        torch._dynamo.reset()
    finally:
        handle.state.trace.counts = None
    handle.revert()


@pytest.mark.slow
def test_compiled_in_the_compiled_decoder_on_the_cpu(monkeypatch):
    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    model = _moe_model("qwen2_moe")
    sequences = _sequences(5)
    handle = ac.patch_model(model, moe_experts="sorted", compiled_decoder=False)
    eager = _actorcore_step(model, sequences, Counter())
    handle.revert()
    torch._dynamo.reset()
    handle = ac.patch_model(model, moe_experts="sorted", compiled_decoder=True)
    trace = Counter()
    fused = _actorcore_step(model, sequences, trace)
    assert trace[COMPILED_TRACE_KEY] == model.config.num_hidden_layers == len(handle.state.targets("moe_experts"))
    # compiled layers take the path by construction (counted by the compiled decoder, not per module); one compilation
    # serves every layer: an object per module in the graph recompiled the layer for each, on a guard on it
    from torch._dynamo.utils import guard_failures

    assert trace[MOE_EXPERTS_KEY] == 0
    assert not [r for reasons in guard_failures.values() for r in reasons if "experts" in str(r)], guard_failures
    _assert_close(eager, fused, TOL["compiled_decoder_vs_eager_fp32"], TOL["grad_compiled_decoder_vs_eager_fp32_rel"])
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"]["unique_graphs"])
    trace = Counter()
    _actorcore_step(model, _sequences(6)[:3], trace)  # another pack (a new trace, other lengths): no recompilation
    assert int(counters["stats"]["unique_graphs"]) == graphs
    assert trace[COMPILED_TRACE_KEY] == model.config.num_hidden_layers
    bypassed = model.model.get_submodule(handle.state.targets("moe_experts")[0])
    installed = bypassed.config
    bypassed.config = model.config  # as if another patch had given the module its config back
    with pytest.raises(PatchNotAppliedError, match=r"MoE experts path ran in 1 of 2 .*names the experts "
                                                   "implementation 'eager'"):
        _actorcore_step(model, sequences, Counter())
    bypassed.config = installed
    handle.revert()
