"""CPU tests of the log-prob/entropy head: chunked torch backend vs the fp32 reference, per token.

Shape suffixes: T tokens, D hidden, V vocab.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from collections import Counter

from actorcore.kernels.logprob import (
    linear_logprob_entropy,
    linear_logprob_entropy_reference,
    linear_logprob_entropy_vocab_shard,
)
from actorcore.kernels.logprob import chunked
from actorcore.parallel.vocab_parallel import linear_logprob_entropy_vocab_parallel
from actorcore.testing.tolerances import TOL

ATOL_FP32 = TOL["kernel_chunked_vs_reference_fp32"]
ATOL_BF16 = TOL["fused_head_bf16_vs_fp32_logits"]
KERNEL_CHUNKED_GRAD_VS_REFERENCE_FP32_REL = TOL["kernel_chunked_grad_vs_reference_fp32_rel"]


def _inputs(n_tok, dim, vocab, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden_TD = torch.randn(n_tok, dim, generator=g).mul(scale).to(dtype)
    weight_VD = (torch.randn(vocab, dim, generator=g) / dim**0.5).mul(3.0).to(dtype)
    labels_T = torch.randint(0, vocab, (n_tok,), generator=g)
    return hidden_TD, weight_VD, labels_T


def _assert_rel_close(actual, expected, rel):
    err = (actual.double() - expected.double()).abs().max().item()
    ref = expected.double().abs().max().item()
    assert err <= rel * max(ref, 1e-30), f"max abs err {err:.3e} > {rel:.0e} * max |ref| {ref:.3e}"


@pytest.mark.parametrize("n_tok", [1, 37, 301])
@pytest.mark.parametrize("dim", [48, 64])
@pytest.mark.parametrize("vocab", [131, 1001])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_chunked_matches_reference_per_token(n_tok, dim, vocab, temperature, softcap):
    hidden_TD, weight_VD, labels_T = _inputs(n_tok, dim, vocab, seed=n_tok + dim + vocab)
    lp, ent = linear_logprob_entropy(
        hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap, backend="torch", chunk_size=16
    )
    lp_ref, ent_ref = linear_logprob_entropy_reference(
        hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap
    )
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert lp.shape == (n_tok,) and ent.shape == (n_tok,)
    torch.testing.assert_close(lp, lp_ref, atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=ATOL_FP32, rtol=0)
    # entropy=False: None and the same log-probs
    lp2, ent2 = linear_logprob_entropy(
        hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap, entropy=False, backend="torch"
    )
    assert ent2 is None
    torch.testing.assert_close(lp2, lp_ref, atol=ATOL_FP32, rtol=0)


def test_softcap_changes_result():
    """Guard against a softcap argument that is silently ignored."""
    hidden_TD, weight_VD, labels_T = _inputs(8, 32, 131, scale=3.0)
    lp_cap, _ = linear_logprob_entropy(hidden_TD, weight_VD, labels_T, softcap=2.0, backend="torch")
    lp_plain, _ = linear_logprob_entropy(hidden_TD, weight_VD, labels_T, backend="torch")
    assert (lp_cap - lp_plain).abs().max() > TOL["logprob_changed_by_transform"]


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (0.7, 3.0)])
@pytest.mark.parametrize("which", ["both", "logprob", "entropy"])
def test_chunked_grads_match_reference(chunk_size, temperature, softcap, which):
    hidden_TD, weight_VD, labels_T = _inputs(37, 48, 1001, seed=3)
    g = torch.Generator().manual_seed(11)
    g_lp_T, g_ent_T = torch.randn(37, generator=g), torch.randn(37, generator=g)

    def run(fn, **kw):
        h = hidden_TD.clone().requires_grad_()
        w = weight_VD.clone().requires_grad_()
        lp, ent = fn(h, w, labels_T, temperature=temperature, softcap=softcap, **kw)
        loss = 0.0
        if which in ("both", "logprob"):
            loss = loss + (lp * g_lp_T).sum()
        if which in ("both", "entropy"):
            loss = loss + (ent * g_ent_T).sum()
        loss.backward()
        return h.grad, w.grad

    gh, gw = run(linear_logprob_entropy, backend="torch", chunk_size=chunk_size)
    gh_ref, gw_ref = run(linear_logprob_entropy_reference)
    assert gh.dtype == hidden_TD.dtype and gw.dtype == weight_VD.dtype
    _assert_rel_close(gh, gh_ref, KERNEL_CHUNKED_GRAD_VS_REFERENCE_FP32_REL)
    _assert_rel_close(gw, gw_ref, KERNEL_CHUNKED_GRAD_VS_REFERENCE_FP32_REL)


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 2.0)])
def test_gradcheck_fp64(temperature, softcap):
    hidden_TD, weight_VD, labels_T = _inputs(5, 6, 7, dtype=torch.float64, seed=5)
    hidden_TD.requires_grad_()
    weight_VD.requires_grad_()

    def fn(h, w):
        return linear_logprob_entropy(
            h, w, labels_T, temperature=temperature, softcap=softcap, backend="torch", chunk_size=2
        )

    assert torch.autograd.gradcheck(fn, (hidden_TD, weight_VD), eps=TOL["gradcheck_fp64"], atol=TOL["gradcheck_fp64"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_fp32_logits(dtype):
    """16-bit inputs: logits accumulate in fp32, so the result matches an fp32 reference on the same
    16-bit values, and is far closer than rounding the logits to 16 bits would be."""
    hidden_TD, weight_VD, labels_T = _inputs(301, 64, 1001, dtype=dtype, seed=7, scale=2.0)
    lp, ent = linear_logprob_entropy(hidden_TD, weight_VD, labels_T, temperature=0.7, backend="torch", chunk_size=50)
    lp_ref, ent_ref = linear_logprob_entropy_reference(
        hidden_TD.float(), weight_VD.float(), labels_T, temperature=0.7
    )
    assert lp.dtype == torch.float32
    err_lp = (lp - lp_ref).abs().max().item()
    err_ent = (ent - ent_ref).abs().max().item()
    assert err_lp <= ATOL_BF16 and err_ent <= ATOL_BF16
    naive_logits = (hidden_TD @ weight_VD.t()).float() / 0.7  # rounded to 16 bits before softmax
    naive_lp = torch.log_softmax(naive_logits, -1).gather(1, labels_T[:, None]).squeeze(1)
    err_naive = (naive_lp - lp_ref).abs().max().item()
    assert err_lp < err_naive / 10, (err_lp, err_naive)
    # grads come back in the input dtype and agree with the reference's to 16-bit rounding
    h = hidden_TD.clone().requires_grad_()
    w = weight_VD.clone().requires_grad_()
    lp, ent = linear_logprob_entropy(h, w, labels_T, temperature=0.7, backend="torch", chunk_size=50)
    (lp.sum() + ent.sum()).backward()
    h32 = hidden_TD.float().requires_grad_()
    w32 = weight_VD.float().requires_grad_()
    lp_r, ent_r = linear_logprob_entropy_reference(h32, w32, labels_T, temperature=0.7)
    (lp_r.sum() + ent_r.sum()).backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    _assert_rel_close(h.grad.float(), h32.grad, 1e-2)
    _assert_rel_close(w.grad.float(), w32.grad, 1e-2)


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any aten op produces (logits included, whoever builds them)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("backend,bounded", [("torch", True), ("reference", False)])
def test_memory_bounded_by_chunk_not_tokens(backend, bounded):
    """No op in forward or backward creates a tensor larger than one [chunk, V] block (the reference,
    which builds [T, V], is the negative control showing the check can fail)."""
    n_tok, dim, vocab, chunk = 200, 32, 1001, 24
    hidden_TD, weight_VD, labels_T = _inputs(n_tok, dim, vocab, seed=9)
    h = hidden_TD.requires_grad_()
    w = weight_VD.requires_grad_()
    trace = Counter()
    with _MaxNumel() as probe:
        lp, ent = linear_logprob_entropy(h, w, labels_T, temperature=0.7, backend=backend, chunk_size=chunk,
                                         trace=trace)
        (lp.sum() + ent.sum()).backward()
    limit = max(chunk * vocab, vocab * dim)
    if bounded:
        assert probe.max_numel <= limit, (probe.max_numel, limit)
        # forward + backward recompute, each over every token in chunks of `chunk` rows (the last shorter)
        assert trace == {"logprob:torch_chunk": 2 * -(-n_tok // chunk), "logprob:torch_chunk_rows": 2 * n_tok}
    else:
        assert probe.max_numel >= n_tok * vocab
        assert trace == {"logprob:reference": 1}


def test_default_chunk_is_bounded():
    assert chunked.default_chunk_rows(151936) * 151936 * 4 <= chunked.CHUNK_BYTES
    assert chunked.default_chunk_rows(151936) % 64 == 0
    assert chunked.default_chunk_rows(10**9) == 1


def test_non_contiguous_inputs():
    hidden_TD, weight_VD, labels_T = _inputs(74, 96, 262, seed=2)
    h_nc, w_nc, y_nc = hidden_TD[::2, ::2], weight_VD[::2, ::2], labels_T[::2] // 2
    assert not h_nc.is_contiguous() and not w_nc.is_contiguous()
    lp, ent = linear_logprob_entropy(h_nc, w_nc, y_nc, backend="torch", chunk_size=5)
    lp_ref, ent_ref = linear_logprob_entropy_reference(h_nc.contiguous(), w_nc.contiguous(), y_nc)
    torch.testing.assert_close(lp, lp_ref, atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=ATOL_FP32, rtol=0)


def test_zero_tokens():
    hidden_TD, weight_VD, _ = _inputs(3, 16, 31)
    lp, ent = linear_logprob_entropy(hidden_TD[:0], weight_VD, torch.zeros(0, dtype=torch.long), backend="auto")
    assert lp.shape == (0,) and ent.shape == (0,)


def test_auto_on_cpu_uses_torch_and_triton_refuses():
    hidden_TD, weight_VD, labels_T = _inputs(9, 16, 31)
    trace = Counter()
    linear_logprob_entropy(hidden_TD, weight_VD, labels_T, backend="auto", trace=trace)
    assert trace == {"logprob:torch_chunk": 1, "logprob:torch_chunk_rows": 9}
    with pytest.raises(ValueError, match="triton"):
        linear_logprob_entropy(hidden_TD, weight_VD, labels_T, backend="triton")


@pytest.mark.parametrize(
    "case,match",
    [
        ("hidden_1d", "hidden_TD must be a 2-D"),
        ("weight_1d", "weight_VD must be a 2-D"),
        ("labels_2d", "labels_T must be a 1-D"),
        ("dim_mismatch", "hidden size mismatch"),
        ("len_mismatch", "tokens"),
        ("dtype_mismatch", "same dtype"),
        ("int_hidden", "hidden_TD dtype"),
        ("float_labels", "int32 or int64"),
        ("label_high", r"\[0, 31\)"),
        ("label_negative", "mask ignored"),
        ("temperature", "temperature"),
        ("softcap", "softcap"),
        ("chunk", "chunk_size"),
        ("backend", "valid backends are auto, reference, torch, triton"),
    ],
)
def test_bad_input_raises_clear_error(case, match):
    hidden_TD, weight_VD, labels_T = _inputs(9, 16, 31)
    kw = {}
    if case == "hidden_1d":
        hidden_TD = hidden_TD[0]
    elif case == "weight_1d":
        weight_VD = weight_VD[0]
    elif case == "labels_2d":
        labels_T = labels_T[:, None]
    elif case == "dim_mismatch":
        weight_VD = weight_VD[:, :8]
    elif case == "len_mismatch":
        labels_T = labels_T[:5]
    elif case == "dtype_mismatch":
        weight_VD = weight_VD.double()
    elif case == "int_hidden":
        hidden_TD = hidden_TD.long()
        weight_VD = weight_VD.long()
    elif case == "float_labels":
        labels_T = labels_T.float()
    elif case == "label_high":
        labels_T = labels_T.clone()
        labels_T[3] = 31
    elif case == "label_negative":
        labels_T = labels_T.clone()
        labels_T[0] = -100
    elif case == "temperature":
        kw["temperature"] = 0.0
    elif case == "softcap":
        kw["softcap"] = -1.0
    elif case == "chunk":
        kw["chunk_size"] = 0
    elif case == "backend":
        kw["backend"] = "cuda-magic"
    with pytest.raises(ValueError, match=match):
        linear_logprob_entropy(hidden_TD, weight_VD, labels_T, **kw)


# ----------------------------------------------------------------------------- vocab parallel
# (the gloo run of two vocabulary shards is tests/dist/test_vocab_parallel_gloo.py)


def test_vocab_parallel_without_group_equals_unsharded():
    hidden_TD, weight_VD, labels_T = _inputs(37, 48, 131, seed=1)
    lp, ent = linear_logprob_entropy_vocab_parallel(
        hidden_TD, weight_VD, labels_T, vocab_start=0, tp_group=None, backend="torch"
    )
    lp_ref, ent_ref = linear_logprob_entropy_reference(hidden_TD, weight_VD, labels_T)
    torch.testing.assert_close(lp, lp_ref, atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=ATOL_FP32, rtol=0)
    with pytest.raises(ValueError, match="vocab_start"):
        linear_logprob_entropy_vocab_parallel(hidden_TD, weight_VD, labels_T, vocab_start=-1, tp_group=None)
    with pytest.raises(ValueError, match="valid"):
        linear_logprob_entropy_vocab_parallel(
            hidden_TD, weight_VD, labels_T, vocab_start=0, tp_group=None, backend="reference"
        )


def test_vocab_shard_merges_statistics_through_the_callers_reduce():
    """The kernel issues no collective: a caller-supplied ``reduce_stats`` (here, the other shards computed
    in-process) turns one shard's statistics into the whole vocabulary's, forward and backward."""
    from actorcore.kernels.logprob import merge_partial_stats
    from actorcore.kernels.logprob.chunked import TorchChunkedEngine

    hidden_TD, weight_VD, labels_T = _inputs(37, 48, 1001, seed=22)
    lo, hi = 400, 700
    others = [(0, lo), (hi, 1001)]
    kw = dict(temperature=0.7, softcap=3.0, entropy=True, chunk_size=None)

    def reduce_stats(stats):
        parts = [stats] + [TorchChunkedEngine().forward_stats(hidden_TD, weight_VD[a:b], labels_T - a, **kw)
                           for a, b in others]
        return merge_partial_stats(*(torch.stack([p[i] for p in parts]) for i in range(4)))

    h = hidden_TD.clone().requires_grad_()
    w = weight_VD[lo:hi].clone().requires_grad_()
    trace = Counter()
    lp, ent = linear_logprob_entropy_vocab_shard(
        h, w, labels_T, vocab_start=lo, reduce_stats=reduce_stats, temperature=0.7, softcap=3.0, backend="torch",
        trace=trace,
    )
    (lp.sum() + ent.sum()).backward()
    h_ref = hidden_TD.clone().requires_grad_()
    w_ref = weight_VD.clone().requires_grad_()
    lp_ref, ent_ref = linear_logprob_entropy_reference(h_ref, w_ref, labels_T, temperature=0.7, softcap=3.0)
    (lp_ref.sum() + ent_ref.sum()).backward()
    torch.testing.assert_close(lp, lp_ref.detach(), atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(ent, ent_ref.detach(), atol=ATOL_FP32, rtol=0)
    _assert_rel_close(w.grad, w_ref.grad[lo:hi], KERNEL_CHUNKED_GRAD_VS_REFERENCE_FP32_REL)
    assert trace == {"logprob:torch_chunk": 2, "logprob:torch_chunk_rows": 2 * 37}  # this shard's work only
    with pytest.raises(ValueError, match="reduce_stats"):
        linear_logprob_entropy_vocab_shard(hidden_TD, w.detach(), labels_T, vocab_start=lo, reduce_stats=3)
