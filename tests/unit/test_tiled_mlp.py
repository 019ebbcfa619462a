"""Tiled MLP kernel: exact against the untiled MLP for every MLP kind our archs use (fp64 bitwise for outputs
and input gradients; parameter gradients bitwise equal to the per-shard sums and within rounding of the
untiled ones), bf16 close, no [T, intermediate] tensors kept for backward, and the tiled path demonstrably ran."""

import pytest
import torch

from actorcore.kernels.tiled_mlp import TOKEN_ALIGNMENT, shard_bounds, tiled_mlp
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

# gated SwiGLU, gated GeGLU (gelu-tanh), fused gate/up, plain (xIELU with parameters of its own).
MLP_ARCHS = {"llama": "gated SwiGLU", "gemma2": "gated GeGLU", "phi3": "fused_gated", "apertus": "plain xIELU"}


def _mlp(model_type, dtype):
    return build_tiny_model(model_type, dtype=dtype).model.layers[0].mlp


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, x):
        self.calls += 1
        return self.fn(x)


def _per_shard_param_grads(mlp, x, grad, shards):
    """Plain autograd on each shard, parameter gradients summed in shard order (what tiling should equal)."""
    params = list(mlp.parameters())
    sums = None
    flat_x, flat_g = x.detach().reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    for a, b in shard_bounds(flat_x.shape[0], shards):
        xs = flat_x[a:b].clone().requires_grad_(True)
        grads = torch.autograd.grad(mlp(xs), [xs, *params], flat_g[a:b])[1:]
        sums = list(grads) if sums is None else [s + g for s, g in zip(sums, grads)]
    return sums


@pytest.mark.parametrize("model_type", sorted(MLP_ARCHS))
@pytest.mark.parametrize("num_tokens,shards", [(77, 3), (301, 5), (23, 4)])
def test_fp64_exact(model_type, num_tokens, shards):
    torch.manual_seed(0)
    mlp = _mlp(model_type, torch.float64)
    params = list(mlp.parameters())
    x = torch.randn(1, num_tokens, 64, dtype=torch.float64, requires_grad=True)
    want = mlp(x)
    grad = torch.randn_like(want)
    want_gx, *want_gp = torch.autograd.grad(want, [x, *params], grad)

    fn = Counting(mlp.forward)
    got = tiled_mlp(fn, x, shards, params)
    got_gx, *got_gp = torch.autograd.grad(got, [x, *params], grad)
    n_shards = len(shard_bounds(num_tokens, shards))
    assert fn.calls == 2 * n_shards, "forward + recompute once per shard"
    assert torch.equal(got, want)
    assert torch.equal(got_gx, want_gx)
    for name_p, g_tiled, g_shards, g_plain in zip(
            [n for n, _ in mlp.named_parameters()], got_gp, _per_shard_param_grads(mlp, x, grad, shards), want_gp):
        assert torch.equal(g_tiled, g_shards), name_p
        rel = ((g_tiled - g_plain).abs().max() / g_plain.abs().max()).item()
        assert rel <= TOL["tiled_mlp_grad_fp64_rel"], f"{name_p}: {rel:.1e}"


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_bf16_close(model_type):
    torch.manual_seed(1)
    mlp = _mlp(model_type, torch.bfloat16)
    params = list(mlp.parameters())
    x = torch.randn(1, 150, 64, dtype=torch.bfloat16, requires_grad=True)
    want = mlp(x)
    grad = torch.randn_like(want)
    want_g = torch.autograd.grad(want, [x, *params], grad)
    got = tiled_mlp(mlp.forward, x, 4, params)
    got_g = torch.autograd.grad(got, [x, *params], grad)
    assert torch.equal(got, want)  # rows are independent: the forward is exact in bf16 too
    for a, b in zip(got_g, want_g):
        assert a.dtype == b.dtype == torch.bfloat16
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= TOL["tiled_mlp_grad_bf16_rel"]


def test_no_intermediates_saved_for_backward():
    mlp = _mlp("llama", torch.float32)
    x = torch.randn(1, 64, 64, requires_grad=True)
    intermediate = mlp.up_proj.out_features

    def saved_shapes(fn):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            fn()
        return shapes

    untiled = saved_shapes(lambda: mlp(x))
    tiled = saved_shapes(lambda: tiled_mlp(mlp.forward, x, 4, list(mlp.parameters())))
    assert any(intermediate in s for s in untiled)  # the check can see intermediates when they exist
    # Only the input and the parameters are kept (parameters are references, not copies).
    assert set(tiled) <= {tuple(x.shape)} | {tuple(p.shape) for p in mlp.parameters()}


def test_no_grad_runs_shards_without_a_graph():
    mlp = _mlp("phi3", torch.float32)
    x = torch.randn(2, 40, 64)
    fn = Counting(mlp.forward)
    with torch.no_grad():
        out = tiled_mlp(fn, x, 3, list(mlp.parameters()))
    assert out.grad_fn is None and fn.calls == len(shard_bounds(80, 3))
    with torch.no_grad():
        assert torch.equal(out, mlp(x))


def test_shard_bounds_cover_tokens_aligned():
    for total in (1, 15, 16, 17, 100, 301):
        for shards in (1, 2, 3, 7, 50):
            bounds = shard_bounds(total, shards)
            assert bounds[0][0] == 0 and bounds[-1][1] == total and len(bounds) <= shards
            assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
            assert all(a % TOKEN_ALIGNMENT == 0 for a, _ in bounds)


def test_bad_shards_and_mismatched_params_are_refused():
    mlp = _mlp("llama", torch.float32)
    x = torch.randn(1, 40, 64, requires_grad=True)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="shards must be a positive int"):
            tiled_mlp(mlp.forward, x, bad, list(mlp.parameters()))
    # The forward reads other parameter objects than the ones passed: an error, not silent zero gradients.
    stranger = torch.nn.Parameter(torch.zeros(3))
    out = tiled_mlp(mlp.forward, x, 2, [stranger])
    with pytest.raises(RuntimeError, match="got no gradient"):
        out.sum().backward()
