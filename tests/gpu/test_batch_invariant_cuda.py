"""Batch-invariant mode on CUDA, bf16: a sequence's log-probs and entropies are bitwise the same in every packing
(alone, first, in the middle, last; packs of very different token counts), forward-only, in a training forward
with activation checkpointing, and through ``compute_loss`` (the Triton loss-fused head).

cuBLAS chooses its GEMM kernel by the row count and the Triton head splits the vocabulary by the token count, so
the plain route differs across these packings (printed, not asserted: the size of the difference is the GPU's).
Skipped without CUDA or triton."""

from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.hf.features.batch_invariant import LINEAR_TRACE_KEY
from actorcore.testing.tiny_configs import tiny_config
from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 32000  # 125 vocabulary tiles: the Triton forward merges several splits


def _model():
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2", vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _packings(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(3, VOCAB, (length,), generator=g)
    o = [torch.randint(3, VOCAB, (n,), generator=g) for n in (1500, 37, 2900, 700, 3)]
    return [("alone", [target], 0), ("start", [target, *o], 0), ("middle", [o[0], o[1], target, *o[2:]], 2),
            ("end", [*o, target], 5), ("short pack", [o[4], target], 1), ("two", [o[3], target, o[1]], 1)]


def _run(model, seqs, index, batch_invariant, grad, trace):
    batch = ac.pack(seqs).to("cuda")
    model.train(grad)
    with torch.set_grad_enabled(grad):
        out = ac.compute_logprobs(model, batch, batch_invariant=batch_invariant, trace=trace)
    if grad:
        (out.log_probs.sum() + out.entropy.sum()).backward()
        model.zero_grad(set_to_none=True)
    lo, hi = int(batch.cu_seqlens[index]), int(batch.cu_seqlens[index + 1])
    return out.log_probs[lo:hi].detach(), out.entropy[lo:hi].detach()


@pytest.mark.parametrize("length", [5, 300, 1700])
def test_bitwise_the_same_in_every_packing_cuda(length):
    pytest.importorskip("triton")
    model = _model()
    for grad in (False, True):
        plain, inv = {}, {}
        for name, seqs, index in _packings(length, seed=length):
            trace = Counter()
            inv[name] = _run(model, seqs, index, True, grad, trace)
            assert trace[LINEAR_TRACE_KEY] == 7 * 3 * (2 if grad else 1)
            assert trace["logprob:triton_forward"] >= 1
            assert trace["varlen_attention:torch_varlen"] + trace["varlen_attention:flash_attn"] + \
                trace["varlen_attention:fa4"] >= 3
            plain[name] = _run(model, seqs, index, False, grad, None)
        for name in inv:
            assert torch.equal(inv[name][0], inv["alone"][0]), (length, grad, name)
            assert torch.equal(inv[name][1], inv["alone"][1]), (length, grad, name)
        worst = max((plain[n][0] - plain["alone"][0]).abs().max().item() for n in plain)
        print(f"length {length} grad {grad}: plain route max |Δ log-prob| across packings {worst:.3g}")
        for name in inv:  # the same numbers up to bf16 roundings of other GEMM kernels (a wrong tile would be O(1))
            assert (inv[name][0] - plain[name][0]).abs().max().item() <= TOL["batch_invariant_vs_plain_bf16"]


def test_compute_loss_bitwise_the_same_in_every_packing_cuda():
    pytest.importorskip("triton")
    model = _model()
    model.train()
    outputs = {}
    for name, seqs, index in _packings(300, seed=1):
        batch = ac.pack(seqs).to("cuda")
        trace = Counter()
        out = ac.compute_loss(model, batch, lambda lp, ent: -lp - 0.01 * ent, batch_invariant=True, trace=trace)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        assert trace["logprob:triton_fused_loss"] >= 1
        lo, hi = int(batch.cu_seqlens[index]), int(batch.cu_seqlens[index + 1])
        outputs[name] = (out.logprob[lo:hi], out.entropy[lo:hi])
    for name, (lp, ent) in outputs.items():
        assert torch.equal(lp, outputs["alone"][0]) and torch.equal(ent, outputs["alone"][1]), name


# Component checks: which part broke, if the model-level test fails.

def _row_slices(n):
    return [(0, 5), (3, 300), (1000, n), (517, 2600), (0, n)]


def test_tiled_linear_rows_do_not_depend_on_the_other_rows_cuda():
    from actorcore.kernels.batch_invariant import tiled_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3000, 1536, device="cuda", generator=g).bfloat16()
    w = torch.randn(8960, 1536, device="cuda", generator=g).bfloat16()
    b = torch.randn(8960, device="cuda", generator=g).bfloat16()
    full = tiled_linear(x, w, b)
    plain_differs = False
    for lo, hi in _row_slices(3000):
        assert torch.equal(tiled_linear(x[lo:hi], w, b), full[lo:hi]), (lo, hi)
        plain_differs |= not torch.equal(torch.nn.functional.linear(x[lo:hi], w, b),
                                         torch.nn.functional.linear(x, w, b)[lo:hi])
    print(f"cuBLAS rows depend on the row count here: {plain_differs}")


def test_varlen_attention_of_a_sequence_does_not_depend_on_its_offset_cuda():
    from actorcore.kernels.attention.varlen import varlen_causal_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1500, 37, 700, 2900, 3]
    for target in (5, 300, 1700):
        for index in (0, 2, 5):
            lens = lengths[:index] + [target] + lengths[index:]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
            q = torch.randn(sum(lens), 12, 128, device="cuda", generator=g).bfloat16()
            k = torch.randn(sum(lens), 2, 128, device="cuda", generator=g).bfloat16()
            v = torch.randn(sum(lens), 2, 128, device="cuda", generator=g).bfloat16()
            lo, hi = int(cu[index]), int(cu[index + 1])
            trace = Counter()
            packed = varlen_causal_attention(q, k, v, cu, max(lens), trace=trace)
            alone = varlen_causal_attention(q[lo:hi].contiguous(), k[lo:hi].contiguous(), v[lo:hi].contiguous(),
                                            torch.tensor([0, target], device="cuda", dtype=torch.int32), target)
            assert torch.equal(packed[lo:hi], alone), (target, index, dict(trace))


def test_triton_head_rows_do_not_depend_on_the_other_rows_cuda():
    pytest.importorskip("triton")
    from actorcore.kernels.logprob import linear_logprob_entropy, linear_logprob_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3000, 1536, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(151936, 1536, device="cuda", generator=g) / 40).bfloat16()
    labels = torch.randint(0, 151936, (3000,), device="cuda", generator=g)
    lp, ent = linear_logprob_entropy(hidden, weight, labels, batch_invariant=True)
    full = linear_logprob_loss(hidden, weight, labels, lambda a, b: -a, batch_invariant=True)
    for lo, hi in _row_slices(3000):
        part = linear_logprob_entropy(hidden[lo:hi], weight, labels[lo:hi], batch_invariant=True)
        assert torch.equal(part[0], lp[lo:hi]) and torch.equal(part[1], ent[lo:hi]), (lo, hi)
        fused = linear_logprob_loss(hidden[lo:hi], weight, labels[lo:hi], lambda a, b: -a, batch_invariant=True)
        assert torch.equal(fused.logprob, full.logprob[lo:hi]) and torch.equal(fused.entropy, full.entropy[lo:hi])
