"""The MoE experts GPU tests' models, batches, fp32 reference and the per-parameter distance checks."""

from __future__ import annotations

import copy
from collections import Counter

import torch

import actorcore as ac
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

from support.compiled_decoder_steps import step


LENGTHS = (7, 64, 1, 33, 90)


def moe_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]).to("cuda")


def moe_model(model_type, seed=1, **overrides):
    model = build_tiny_model(model_type, seed=seed, dtype=torch.bfloat16, **overrides).cuda().train()
    model.set_experts_implementation("eager")  # transformers' per-expert loop (what "False" keeps)
    return model


def routing_of(num_tokens, top_k, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).cuda()


def module_runner(tokens, hidden, num_experts):
    """``run(module, forward, dtype)``: an experts forward on fixed random inputs (top-2 routing) and its gradients
    for the inputs, the routing weights and the module's parameters, all as float32."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
    index = routing_of(tokens, 2, num_experts, seed=3)
    weights = torch.rand(tokens, 2, generator=g).to("cuda", torch.bfloat16)
    grad = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)

    def run(module, forward, dtype):
        inputs = [x.to(dtype).requires_grad_(True), weights.to(dtype).requires_grad_(True)]
        out = forward(inputs[0], index, inputs[1])
        grads = torch.autograd.grad(out, [*inputs, *module.parameters()], grad.to(dtype))
        return [t.float() for t in (out, *grads)]

    return run


def assert_module_runs(module, want, baseline, path, again):
    """Two runs of the path bitwise equal; each output and gradient within bf16 rounding of fp32 (``want``) and no
    further from it than the baseline bf16 run (twice its error, plus a floor)."""
    names = ["out", "x", "weights", *[n for n, _ in module.named_parameters()]]
    for name, a, b in zip(names, path, again):
        assert torch.equal(a, b), f"two runs differ in {name}"
    for name, w, e, p in zip(names, want, baseline, path):
        scale = w.abs().max().item()
        err_base, err_path = (e - w).abs().max().item(), (p - w).abs().max().item()
        assert err_path <= TOL["moe_experts_module_vs_fp32_bf16_rel"] * scale, (name, err_path, scale)
        assert err_path <= 2 * err_base + 1e-3 * scale, (name, err_path, err_base)


def fp32_reference(model, batch):
    """The same bf16 values in fp32, eager decoder, transformers' eager experts: log-probs, entropies, gradients."""
    reference = copy.deepcopy(model).float()
    reference.set_experts_implementation("eager")
    handle = ac.patch_model(reference, moe_experts=False, compiled_decoder=False)
    out = step(reference, batch, Counter())
    handle.revert()
    return out


def grad_distance(run, reference):
    """Max |Δ log-prob| and each parameter's gradient distance as a fraction of the reference gradient's norm."""
    grads = {n: ((run[2][n] - g).norm() / (g.norm() + 1e-12)).item() for n, g in reference[2].items()}
    return (run[0] - reference[0]).abs().max().item(), grads


def assert_no_further_from_fp32(path, baseline, baseline_name):
    """The path's ``grad_distance`` to the fp32 model within the table's factor (plus a floor) of the baseline's: its
    max log-prob difference and every parameter's gradient distance."""
    (lp_b, grads_b), (lp_p, grads_p) = baseline, path
    factor, floor = TOL["moe_path_vs_fp32_over_transformers_factor"], TOL["moe_path_vs_fp32_over_transformers_floor"]
    assert lp_p <= factor * lp_b + floor, (lp_p, lp_b)
    worse = {n: (round(grads_p[n], 4), round(grads_b[n], 4))
             for n in grads_b if grads_p[n] > factor * grads_b[n] + floor}
    assert not worse, f"gradients further from fp32 than {baseline_name} (path, {baseline_name}): {worse}"
