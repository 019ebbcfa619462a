"""Batch-invariant mode (``batch_invariant=True``): a sequence's log-probs and entropies are bitwise the same
whatever it is packed with, wherever it sits and whatever the pack's token count, forward-only and with grad.

On these CPUs the plain route is not invariant: torch's CPU matmul (MKL / oneDNN) runs calls of few rows through
other kernels than calls of more (which row counts, depends on the CPU and the widths: 1-3, 5-7 or 9-11 rows
against 4, 8 or >= 12 on one CPU), so a short sequence packed alone gets other log-probs than the same sequence
packed with others (measured below, at the matmul and at the model level).
"""

import copy
from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.hf.features.batch_invariant import LINEAR_TRACE_KEY, NORM_TRACE_KEY
from actorcore.kernels.batch_invariant import tiled_linear, tiled_rows
from actorcore.kernels.logprob import linear_logprob_entropy, linear_logprob_loss
from actorcore.kernels.logprob.triton_blocking import FWD_CONFIG, forward_grid
from actorcore.testing.reference import reference_logprobs, right_padded
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

OTHERS = (40, 17, 63, 5, 2)


def _packings(length: int, seed: int):
    """(name, sequences, index of the target) for one target sequence of ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(3, 131, (length,), generator=g)
    o = [torch.randint(3, 131, (n,), generator=g) for n in OTHERS]
    return [("alone", [target], 0), ("start", [target, *o], 0), ("middle", [o[0], o[1], target, *o[2:]], 2),
            ("end", [*o, target], 5), ("short pack", [o[3], target], 1), ("between", [o[4], target, o[4]], 1)]


def _target_outputs(model, seqs, index, batch_invariant, grad, trace=None):
    batch = ac.pack(seqs)
    with torch.set_grad_enabled(grad):
        out = ac.compute_logprobs(model, batch, batch_invariant=batch_invariant, trace=trace)
    if grad:
        (out.log_probs.sum() + out.entropy.sum()).backward()  # the training forward's backward runs too
    lo, hi = int(batch.cu_seqlens[index]), int(batch.cu_seqlens[index + 1])
    return out.log_probs[lo:hi].detach(), out.entropy[lo:hi].detach()


def test_cpu_matmul_rows_depend_on_the_row_count_and_tiles_do_not():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 88, generator=g), torch.randn(131, 88, generator=g)
    full = torch.nn.functional.linear(x, w)
    differs = [m for m in range(1, 17) if not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m])]
    assert differs, "torch's CPU matmul became row-invariant here: update this module's docstring"
    tiled_full = tiled_linear(x, w, tile_rows=16)
    for m in range(1, 65):
        assert torch.equal(tiled_linear(x[:m], w, tile_rows=16), tiled_full[:m])
        assert torch.equal(tiled_linear(x[64 - m:], w, tile_rows=16), tiled_full[64 - m:])  # other positions
    torch.testing.assert_close(tiled_full, full, rtol=0, atol=TOL["kernel_chunked_vs_reference_fp32"])


def test_narrow_linears_get_taller_tiles_and_stay_invariant():
    from actorcore.kernels.batch_invariant import MAX_TILE_ROWS, TILE_ROWS, linear_tile_rows

    # Qwen2.5-1.5B's gate/up (8960 outputs), q/o and down (1536), k/v (256); a 1-output linear gets the cap.
    assert [linear_tile_rows(n) for n in (8960, 1536, 256, 1)] == [TILE_ROWS, 2 * TILE_ROWS, MAX_TILE_ROWS,
                                                                  MAX_TILE_ROWS]
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(300, 24, generator=g), torch.randn(20, 24, generator=g)
    full = tiled_linear(x, w)  # the default: linear_tile_rows(20) rows per tile
    for m in (1, 7, 299):
        assert torch.equal(tiled_linear(x[:m], w), full[:m]) and torch.equal(tiled_linear(x[300 - m:], w), full[-m:])


def test_tiled_linear_gradients_and_tiled_rows_match_plain_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 19, 12, generator=g, dtype=torch.float64, requires_grad=True)
    lin = torch.nn.Linear(12, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x, w, b: tiled_linear(x, w, b, tile_rows=8), (x, lin.weight, lin.bias),
                                    eps=TOL["gradcheck_fp64"], atol=TOL["gradcheck_fp64"])
    norm = torch.nn.RMSNorm(12, dtype=torch.float64)
    out = tiled_rows(norm, x, tile_rows=8)  # 38 rows: the last tile overlaps the previous one
    torch.testing.assert_close(out, norm(x), rtol=0, atol=TOL["attention_fp64_vs_plain"])
    assert torch.autograd.gradcheck(lambda x: tiled_rows(norm, x, tile_rows=8), (x,), eps=TOL["gradcheck_fp64"],
                                    atol=TOL["gradcheck_fp64"])
    assert torch.autograd.gradcheck(lambda x: tiled_rows(norm, x, tile_rows=64), (x,), eps=TOL["gradcheck_fp64"],
                                    atol=TOL["gradcheck_fp64"])  # fewer rows than a tile: zero-padded
    with pytest.raises(ValueError, match="tile_rows"):
        tiled_linear(x, lin.weight, tile_rows=0)


# llama: forward-only; qwen3 (q/k norms per head): a training forward with activation checkpointing and backward
@pytest.mark.parametrize("model_type,length,grad", [("llama", 3, False), ("qwen3", 7, True)])
def test_a_sequence_is_bitwise_the_same_in_every_packing(model_type, length, grad):
    model = build_tiny_model(model_type)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(grad)
    layers = model.config.num_hidden_layers
    norms_per_layer = sum(type(m).__name__.endswith("RMSNorm") for m in model.model.layers[0].modules())
    outputs = {}
    for name, seqs, index in _packings(length, seed=length):
        trace = Counter()
        outputs[name] = _target_outputs(model, seqs, index, True, grad, trace)
        assert trace[LINEAR_TRACE_KEY] == 7 * layers * (2 if grad else 1)  # with grad: the checkpoint recompute
        # every norm of the forward (the recomputation may stop early once it has what backward needs)
        assert trace[NORM_TRACE_KEY] >= norms_per_layer * layers + 1
    alone = outputs["alone"]
    for name, (lp, ent) in outputs.items():
        assert torch.equal(lp, alone[0]) and torch.equal(ent, alone[1]), (model_type, length, grad, name)
    for module in model.modules():  # the per-call forwards are gone, recomputation included
        assert "forward" not in module.__dict__


def test_without_the_mode_some_packing_differs_on_this_cpu():
    # Two widths: the tiny default, at which the CPUs before switched kernels with the row count, and one at which a
    # CPU with AMX does (at the default it gave every packing the same bits).
    models = (build_tiny_model("llama"), build_tiny_model("llama", hidden_size=96, num_attention_heads=4,
                                                          num_key_value_heads=2, head_dim=24, intermediate_size=192))
    differs = []
    for model in models:
        for length in (3, 7):
            outputs = {name: _target_outputs(model, seqs, i, False, False) for name, seqs, i in _packings(length, length)}
            differs += [name for name, (lp, _) in outputs.items() if not torch.equal(lp, outputs["alone"][0])]
    assert differs, "the plain route became batch-invariant on this CPU: update this module's docstring"


def test_the_mode_agrees_with_the_models_own_forward_per_token():
    model = build_tiny_model("qwen2")
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 131, (n,), generator=g) for n in (1, 23, 5, 40, 9)]
    ids, mask = right_padded(seqs)
    with torch.no_grad():
        out = ac.compute_logprobs(model, ac.pack_padded(ids, mask), batch_invariant=True)
        ref_lp, ref_ent = reference_logprobs(model, ids, mask, 1.0)
    assert (out.log_probs - ref_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy - ref_ent).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    with torch.no_grad():  # the padded entry point takes the option too: the same numbers in the [B, S] grid
        grid = ac.compute_logprobs_padded(model, ids, mask, batch_invariant=True)
    assert torch.equal(grid.log_probs[mask.bool()], out.log_probs)


def test_compute_loss_is_batch_invariant_and_trains():
    model = build_tiny_model("llama")
    model.train()

    def loss_fn(logprob, entropy):
        return -logprob - 0.01 * entropy

    outputs, grads = {}, {}
    for name, seqs, index in _packings(7, seed=7)[:4]:
        batch = ac.pack(seqs)
        out = ac.compute_loss(model, batch, loss_fn, batch_invariant=True)
        out.loss.backward()
        lo, hi = int(batch.cu_seqlens[index]), int(batch.cu_seqlens[index + 1])
        outputs[name] = (out.logprob[lo:hi], out.entropy[lo:hi])
        grads[name] = model.model.layers[0].mlp.down_proj.weight.grad.clone()
        model.zero_grad(set_to_none=True)
    for name, (lp, ent) in outputs.items():
        assert torch.equal(lp, outputs["alone"][0]) and torch.equal(ent, outputs["alone"][1]), name
    # the loss trains: the gradient of the plain route and of the mode agree
    batch = ac.pack(_packings(7, seed=7)[1][1])
    ac.compute_loss(model, batch, loss_fn, batch_invariant=False).loss.backward()
    plain = model.model.layers[0].mlp.down_proj.weight.grad.clone()
    rel = ((grads["start"] - plain).abs().max() / plain.abs().max()).item()
    assert rel <= TOL["grad_packed_vs_hf_fp32_rel"]


def test_torch_head_is_invariant_to_the_other_rows():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(50, 16, generator=g), torch.randn(131, 16, generator=g)
    labels = torch.randint(0, 131, (50,), generator=g)
    lp, ent = linear_logprob_entropy(hidden, weight, labels, backend="torch", batch_invariant=True, chunk_size=32)
    for lo, hi in ((0, 1), (3, 10), (20, 50), (7, 41)):
        part = linear_logprob_entropy(hidden[lo:hi], weight, labels[lo:hi], backend="torch", batch_invariant=True,
                                      chunk_size=32)
        assert torch.equal(part[0], lp[lo:hi]) and torch.equal(part[1], ent[lo:hi])
        fused = linear_logprob_loss(hidden[lo:hi], weight, labels[lo:hi], lambda a, b: a, backend="torch",
                                    batch_invariant=True)
        assert torch.equal(fused.logprob, lp[lo:hi]) and torch.equal(fused.entropy, ent[lo:hi])


def test_triton_forward_split_does_not_depend_on_tokens_or_gpu_in_the_mode():
    grids = {forward_grid(n, 151936, FWD_CONFIG, sms, batch_invariant=True)[1:] for n in (1, 300, 70000)
             for sms in (78, 132)}
    assert len(grids) == 1
    assert len({forward_grid(n, 151936, FWD_CONFIG, 132)[1:] for n in (1, 300, 70000)}) > 1  # the plain grid does


def test_refusals():
    with pytest.raises(ValueError, match="mixture of experts"):
        ac.compute_logprobs(build_tiny_model("qwen2_moe"), ac.pack([torch.tensor([3, 4, 5])]), batch_invariant=True)
    model = build_tiny_model("llama")
    batch = ac.pack([torch.tensor([3, 4, 5])])
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        ac.compute_logprobs(model, batch, batch_invariant="yes")
    with pytest.raises(ValueError, match="reference"):
        linear_logprob_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), backend="reference",
                               batch_invariant=True)
    copy.deepcopy(model)  # nothing is left on the instance after a call


def test_lora_model_is_batch_invariant_and_its_adapters_train():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_tiny_model("llama"),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero adapters, so they change the outputs
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(0))
    outputs = {}
    for name, seqs, index in _packings(7, seed=7)[:3]:
        trace = Counter()
        outputs[name] = _target_outputs(model, seqs, index, True, True, trace)
        assert trace[LINEAR_TRACE_KEY] == (7 + 2 * 3) * 2  # base layers and both adapter linears of 3 targets
    for name, (lp, ent) in outputs.items():
        assert torch.equal(lp, outputs["alone"][0]) and torch.equal(ent, outputs["alone"][1]), name
    assert all((p.grad is not None) == ("lora_" in n) for n, p in model.named_parameters())
