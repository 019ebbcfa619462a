"""CUDA: FlashAttention-4 as the packed attention (``backend="fa4"``, ``kernels.attention.fa4``) per element against an
fp32 reference: the output and the gradients of q, k, v (and of the sinks), on ragged packs with 1-token sequences,
grouped-query heads, sliding windows, softcap, sinks, head dims 64-256, fp16, and a 128K-token sequence; each no
further from fp32 than twice the error of FlashAttention-2 (torch's ``varlen_attn``) or, where FA2 has no such
feature, of the exact per-sequence path in the same 16-bit dtype. Then the HF route with FA4 (eager and traced into
the compiled decoder's compiled layers) against the model's own fp32 forward, and a sequence's output independent of
where it sits in the pack. The trace proves FA4 ran.

Skipped without a Hopper GPU with flash-attn-4 (and the quack / CuTe DSL it runs on).

Legend: ``T`` packed tokens, ``N`` query heads, ``K`` key/value heads, ``G`` query heads per kv head, ``H`` head dim.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from support.cuda_fp32 import exact_fp32  # noqa: F401 - autouse: the fp32 reference's matmuls without TF32
from torch.utils.checkpoint import checkpoint


def _fa4_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    from actorcore.kernels.attention.backends import device_capability
    from actorcore.kernels.attention.fa4 import fa4_refusal

    return fa4_refusal(torch.device("cuda"), torch.bfloat16, 128, device_capability(torch.device("cuda")))


pytestmark = pytest.mark.skipif(_fa4_missing() is not None, reason=str(_fa4_missing()))


def _reference(q, k, v, cu, *, scale, window=None, softcap=None, sinks=None, chunk=512):
    """fp32 causal attention per sequence in plain torch, independent of actorcore's code: each chunk of queries
    against the keys it can see (its causal prefix, or the window's band), recomputed in backward
    (``torch.utils.checkpoint``) so a 128K-token sequence fits."""
    K, G = k.shape[1], q.shape[1] // k.shape[1]

    def attend(q_CKGH, k_LKH, v_LKH, sinks_N, first_query, first_key):
        s_KGCL = torch.einsum("ckgh,lkh->kgcl", q_CKGH, k_LKH) * scale
        if softcap is not None:
            s_KGCL = softcap * torch.tanh(s_KGCL / softcap)
        i = first_query + torch.arange(q_CKGH.shape[0], device=q.device)[:, None]
        j = first_key + torch.arange(k_LKH.shape[0], device=q.device)[None, :]
        visible = (j <= i) & ((i - j < window) if window else True)
        s_KGCL = s_KGCL.masked_fill(~visible, -math.inf)
        if sinks_N is not None:
            s_KGCL = torch.cat([s_KGCL, sinks_N.view(K, G, 1, 1).expand(K, G, s_KGCL.shape[2], 1)], dim=-1)
        p_KGCL = torch.softmax(s_KGCL, dim=-1)[..., :k_LKH.shape[0]]
        return torch.einsum("kgcl,lkh->ckgh", p_KGCL, v_LKH).flatten(1, 2)

    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for c0 in range(a, b, chunk):
            c1 = min(c0 + chunk, b)
            lo = max(a, c0 - window + 1) if window else a
            outs.append(checkpoint(attend, q[c0:c1].unflatten(1, (K, G)), k[lo:c1], v[lo:c1], sinks, c0 - a, lo - a,
                                   use_reentrant=False))
    return torch.cat(outs)


def _inputs(lengths, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), n, head_dim, device="cuda", dtype=dtype, generator=g)
               for n in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return q, k, v, cu


def _run(backend, q, k, v, cu, max_len, grad_out, sinks, **kwargs):
    """``(out, dq, dk, dv[, dsinks])`` of ``varlen_causal_attention`` on ``backend``, and its trace."""
    from actorcore.kernels.attention.varlen import varlen_causal_attention

    leaves = [x.detach().requires_grad_() for x in (q, k, v)] + ([sinks.detach().requires_grad_()]
                                                               if sinks is not None else [])
    trace = Counter()
    out = varlen_causal_attention(*leaves[:3], cu, max_len, sinks=leaves[3] if sinks is not None else None,
                                  backend=backend, trace=trace, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out.detach(), *grads], trace


# name: (lengths, (N, K, H), dtype, window, softcap, sinks). Ragged RL packs with 1-token sequences; the
# Qwen2.5-1.5B (12/2) and Qwen3-8B (32/8) heads; gpt-oss's (64 head dim, a 128 window, sinks); Gemma's softcap and 256
# head dim; fp16; one 128K-token sequence (the long-context path).
RL_PACK = [1, 300, 4096, 1, 77, 2048, 5, 1000]
CASES = {
    "rl_pack_12q_2kv": (RL_PACK, (12, 2, 128), torch.bfloat16, None, None, False),
    "rl_pack_32q_8kv": (RL_PACK, (32, 8, 128), torch.bfloat16, None, None, False),
    "window_1024": ([1, 3000, 129, 2000], (12, 2, 128), torch.bfloat16, 1024, None, False),
    "fp16": (RL_PACK, (12, 2, 128), torch.float16, None, None, False),
    "softcap_50": ([1, 700, 1500, 3], (8, 2, 128), torch.bfloat16, None, 50.0, False),
    "sinks_window_128_hd64": ([1, 700, 1500, 3], (16, 2, 64), torch.bfloat16, 128, None, True),
    "hd256": ([1, 1000, 513], (8, 1, 256), torch.bfloat16, None, None, False),
    "long_131072": ([131072], (12, 2, 128), torch.bfloat16, None, None, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fa4_matches_fp32_per_element_and_is_no_worse_than_fa2(case):
    from actorcore.kernels.attention.backends import _has_torch_varlen
    from actorcore.testing.tolerances import TOL

    lengths, (N, K, H), dtype, window, softcap, with_sinks = CASES[case]
    q, k, v, cu = _inputs(lengths, N, K, H, dtype, seed=len(case))
    g = torch.Generator(device="cuda").manual_seed(7)
    grad_out = torch.randn(sum(lengths), N, H, device="cuda", dtype=dtype, generator=g)
    sinks = torch.randn(N, device="cuda", generator=g) * 2 if with_sinks else None
    kwargs = dict(scale=H ** -0.5, sliding_window=window, softcap=softcap)
    fa4, trace = _run("fa4", q, k, v, cu, max(lengths), grad_out, sinks, **kwargs)
    assert trace == {"varlen_attention:fa4": 1}
    baseline = "torch_varlen" if softcap is None and not with_sinks and _has_torch_varlen() else "segments"
    other, _ = _run(baseline, q, k, v, cu, max(lengths), grad_out, sinks, **kwargs)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)] + ([sinks.clone().requires_grad_()]
                                                                         if with_sinks else [])
    out = _reference(*leaves[:3], cu, scale=H ** -0.5, window=window, softcap=softcap,
                     sinks=leaves[3] if with_sinks else None)
    ref = [out.detach(), *torch.autograd.grad(out, leaves, grad_out.float())]
    for name, got, base, want in zip(("out", "dq", "dk", "dv", "dsinks"), fa4, other, ref):
        err, base_err = ((x.float() - want).abs().max().item() for x in (got, base))
        scale = want.abs().max().item()
        assert torch.isfinite(got).all(), name
        assert err <= 2 * base_err + 1e-6 * scale, f"{case} {name}: FA4 {err:.3e} vs {baseline} {base_err:.3e}"
        limit = TOL["cp_flash_bf16_vs_fp32"] if name == "out" else TOL["grad_flash_bf16_vs_fp32_rel_max"] * scale
        assert err <= limit, f"{case} {name}: FA4 {err:.3e} over {limit:.3e}"


def test_fa4_output_of_a_sequence_does_not_depend_on_its_place_in_the_pack():
    """The batch-invariant mode relies on attention being per sequence: FA4's forward gives each sequence the same
    bits wherever it sits and whatever its neighbours."""
    from actorcore.kernels.attention.varlen import varlen_causal_attention

    lengths = [1500, 37, 700, 2900, 3]
    g = torch.Generator(device="cuda").manual_seed(0)
    for target in (5, 300, 1700):
        for index in (0, 2, 5):
            lens = lengths[:index] + [target] + lengths[index:]
            q, k, v, cu = _inputs(lens, 12, 2, 128, torch.bfloat16, seed=target + index)
            lo, hi = int(cu[index]), int(cu[index + 1])
            packed = varlen_causal_attention(q, k, v, cu, max(lens), backend="fa4")
            alone = varlen_causal_attention(q[lo:hi].contiguous(), k[lo:hi].contiguous(), v[lo:hi].contiguous(),
                                            torch.tensor([0, target], device="cuda", dtype=torch.int32), target,
                                            backend="fa4")
            assert torch.equal(packed[lo:hi], alone), (target, index)
    del g


def _tiny_batch(model):
    import actorcore as ac

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=g) for n in (1, 2, 300, 77, 17)]
    return seqs, ac.pack(seqs).to("cuda")


def _step(model, batch, **patch):
    """Log-probs ``[T]`` and parameter gradients of one forward+backward through actorcore, and the call's trace."""
    import actorcore as ac

    handle = ac.patch_model(model, moe_experts=False, **patch)
    model.zero_grad(set_to_none=True)
    trace = Counter()
    out = ac.compute_logprobs(model, batch, trace=trace)
    out.log_probs.sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    choice = handle.plan["attention"]
    handle.revert()
    return out.log_probs.detach(), grads, trace, choice


# head dim 64 (the tiny configs' 16 is not among fa4.HEAD_DIMS: the first GPU run of this test, at 16, found the
# gradients through FA4 1.29 from fp32 against FA2's 0.011, its forward exact)
HF_ROUTE_SIZES = {"qwen2": dict(hidden_size=256), "gpt_oss": dict(head_dim=64)}


@pytest.mark.parametrize("model_type,fused", [("qwen2", False), ("qwen2", True), ("gpt_oss", False)])
def test_hf_route_on_fa4_is_as_close_to_fp32_as_fa2(model_type, fused):
    """A bf16 model patched with ``attention_backend="fa4"`` (eager, or its attention traced into the compiled decoder's
    compiled layers; gpt-oss: sinks and alternating windows) against the same weights' fp32 forward, per token and
    per parameter gradient: no further from it than FA2 (the per-sequence path for sinks) on the same model."""
    from actorcore.hf.features.compiled_decoder import COMPILED_TRACE_KEY
    from actorcore.testing.reference import reference_logprobs, right_padded
    from actorcore.testing.tiny_configs import build_tiny_model
    from actorcore.testing.tolerances import TOL

    sizes = HF_ROUTE_SIZES[model_type]  # a head dim FA4 is taken for (fa4.HEAD_DIMS)
    fp32 = build_tiny_model(model_type, seed=3, **sizes).cuda()
    if model_type == "gpt_oss":
        with torch.no_grad():
            for layer in fp32.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator(device="cuda").manual_seed(1))
    model = build_tiny_model(model_type, seed=3, dtype=torch.bfloat16, **sizes).cuda()
    model.load_state_dict(fp32.state_dict())
    seqs, batch = _tiny_batch(model)
    layers = model.config.num_hidden_layers
    ids, mask = right_padded(seqs)
    ref_lp, _ = reference_logprobs(fp32, ids.cuda(), mask.cuda())
    ref_lp.sum().backward()
    ref_grads = {n: p.grad for n, p in fp32.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}

    results = {}
    baseline = "segments" if model_type == "gpt_oss" else "torch_varlen"  # FA2, or the per-sequence path for sinks
    for backend in (baseline, "fa4"):
        lp, grads, trace, choice = _step(model, batch, attention_backend=backend, compiled_decoder=fused)
        grad_errs = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items()}
        results[backend] = ((lp - ref_lp).abs().max().item(), grad_errs, trace, choice)
    lp_err, grad_errs, trace, choice = results["fa4"]
    default_lp_err, default_grad_errs, default_trace, default_choice = results[baseline]
    assert choice.value == "fa4" and trace["varlen_attention:fa4"] == layers, dict(trace)
    assert trace["attention:actorcore_packed"] == layers and default_trace[f"varlen_attention:{baseline}"] == layers
    if fused:  # FA4's op counted inside every compiled layer's graph (the compiled decoder counts graph-held attention)
        assert trace[COMPILED_TRACE_KEY] == layers
    assert lp_err <= 2 * default_lp_err + 1e-3 and lp_err < TOL["fa4_hf_route_bf16_vs_fp32_cap"], \
        (lp_err, default_lp_err, default_choice.line())
    # Per parameter: no further from fp32 than the baseline's gradient (x2); under the cap wherever the baseline is.
    # (gpt-oss's tiny bf16 router flips a token's top-k expert against fp32: its experts' and router's gradients
    # are past the cap on the baseline too, 0.44 on the H200 on 2026-12-07, FA4 0.40.)
    cap = TOL["fa4_hf_route_bf16_vs_fp32_cap"]
    for name, err in grad_errs.items():
        base = default_grad_errs[name]
        assert err <= 2 * base + 1e-3 and (err < cap or base >= cap), (name, err, base, default_choice.line())
    capped = [n for n, base in default_grad_errs.items() if base < cap]
    assert any("attn" in n for n in capped), sorted(default_grad_errs.items())  # the attention's gradients are held
