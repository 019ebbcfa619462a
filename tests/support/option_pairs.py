"""``patch_model``'s options two at a time, and with a batch-invariant call: what each pair asks for, which pairs the
plan refuses (and the words its error says), and the check that a pair that runs works as asked: per token and per
parameter gradient against the model's own forward in fp32, and the call's trace proving every requested feature
ran (or, in a batch-invariant call, stood down as the plan says). Shared by ``tests/unit/test_patch_plan.py`` (CPU)
and ``tests/gpu/test_patch_plan_cuda.py``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from actorcore.testing.tiny_configs import checkpointed  # noqa: F401 (the models of the pairs run it)

# One asking value per option (two for checkpointing, three attention backends); None: the per-call option
# batch_invariant=True.
ASKS: dict[str, dict[str, Any] | None] = {
    "segments": {"attention_backend": "segments"},  # runs everywhere
    "torch_varlen": {"attention_backend": "torch_varlen"},  # 16-bit CUDA only
    "fa4": {"attention_backend": "fa4"},  # Hopper with flash-attn-4 only (or its stand-in)
    "tiled_mlp": {"tiled_mlp_shards": 2},
    "offload": {"offload_activations": True},
    "recompute_norms": {"recompute_norms": True},
    "selective": {"checkpointing": "selective"},
    "budgeted": {"checkpointing": "auto", "memory_budget_gib": 1e6},  # room for every layer of a tiny model
    "compiled_decoder": {"compiled_decoder": True},
    "moe_experts": {"moe_experts": "sorted"},
    "swiglu_mlp": {"swiglu_mlp": "quack"},
    "batch_invariant": None,
}
# The decoder feature each ask turns on (its name in the call's trace: ``plan:<feature>``).
FEATURE = {"segments": "packed_attention", "torch_varlen": "packed_attention", "fa4": "packed_attention",
           "tiled_mlp": "tiled_mlp", "offload": "activation_offload", "recompute_norms": "recompute_norms",
           "selective": "checkpointing", "budgeted": "checkpointing", "compiled_decoder": "compiled_decoder",
           "moe_experts": "moe_experts", "swiglu_mlp": "swiglu_mlp", "batch_invariant": "batch_invariant"}
# Pairs refused (at patch time, or for the batch-invariant call before any work) and what the error says.
REFUSED: dict[frozenset, str] = {
    frozenset({"tiled_mlp", "moe_experts"}): "tiled MLP does not support",  # tiled MLP refuses MoE models
    frozenset({"compiled_decoder", "selective"}): "cannot both hold",
    frozenset({"recompute_norms", "batch_invariant"}): "do not combine",
    frozenset({"moe_experts", "batch_invariant"}): "batch_invariant=True does not support",  # MoE models
}
# Features a batch-invariant call stands down (the model's own code runs, through the invariant linears).
STANDS_DOWN = {"compiled_decoder", "swiglu_mlp"}
# The tiny models: a dense one (every option but the MoE path) and an MoE one with a dense shared expert.
DENSE_MODEL, MOE_MODEL = "qwen2", "qwen2_moe"
LENGTHS = (11, 4, 7)
TEMPERATURE = 0.9


def option_pairs() -> list[tuple[str, str]]:
    """Every pair of asks of two different options (no keyword asked twice)."""
    return [(a, b) for a, b in itertools.combinations(ASKS, 2) if not set(ASKS[a] or ()) & set(ASKS[b] or ())]


def backend_refusals(pairs: list[tuple[str, str]], why: dict[str, str | None]) -> dict[frozenset, str]:
    """The pairs refused because their attention backend cannot run here: ``why`` maps an attention-backend ask to
    the words of its refusal (None: it runs)."""
    return {frozenset(pair): why[ask] for pair in pairs for ask in pair if why.get(ask) is not None}


def model_type_for(pair: tuple[str, str]) -> str:
    return MOE_MODEL if "moe_experts" in pair else DENSE_MODEL


def sequences(vocab: int = 131, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]


def _weights(n: int, device: Any) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, n, device=device)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@dataclass
class Reference:
    """The model's own forward, one sequence at a time, in fp32: per-token log-probs ``[T]`` and the gradients of
    the weighted sum of them."""

    log_probs: torch.Tensor
    grads: dict[str, torch.Tensor]


def own_forward(model: torch.nn.Module, seqs: list[torch.Tensor]) -> Reference:
    """``Reference`` from ``model`` (unpatched, fp32) itself."""
    device = next(model.parameters()).device
    lps = []
    for ids in seqs:
        ids = ids.to(device)
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        lps.append(torch.cat([logp.new_zeros(1), logp[:-1].gather(-1, ids[1:, None])[:, 0]]))
    lp = torch.cat(lps)
    (lp * _weights(lp.numel(), device)).sum().backward()
    return Reference(lp.detach(), _grads(model))


@dataclass(frozen=True)
class Tolerances:
    log_prob: float  # per token, absolute
    grad: float  # per parameter: the largest |difference| relative to the reference gradient's largest |value|
    grad_by_norm: bool = False  # instead: the difference's L2 norm relative to the reference's (16-bit models)
    # 16-bit models: the same weights' own forward in that dtype (unpatched). A parameter whose own 16-bit gradient is
    # already further than ``grad`` from fp32 (an MoE router where bf16 flips a token's top-k choice) may be as far as
    # ``own_factor`` times that distance, no further.
    own_16bit: Reference | None = None
    own_factor: float = 1.0

    def grad_allowance(self, name: str, ref: torch.Tensor) -> float:
        if self.own_16bit is None:
            return self.grad
        return max(self.grad, self.own_factor * _relative(self.own_16bit.grads[name] - ref, ref, self.grad_by_norm))


def _relative(diff: torch.Tensor, ref: torch.Tensor, by_norm: bool) -> float:
    if by_norm:
        return diff.norm().item() / max(ref.norm().item(), 1e-12)
    return diff.abs().max().item() / max(ref.abs().max().item(), 1e-12)


def run_pair(model: torch.nn.Module, pair: tuple[str, str], seqs: list[torch.Tensor], want: Reference,
             tol: Tolerances, parallel: Any = None) -> Counter:
    """Patch ``model`` with the pair's options, run one training call (and, with a batch-invariant call, the first
    sequence alone), compare with ``want`` and the trace; returns the trace. The patch is reverted and the gradients
    cleared. A refused pair raises its ``ValueError`` before any work. ``parallel``: an SP context, the pair's
    ``"sp"`` ask (every rank passes the same batch; the gradients compared are the SP group's average)."""
    import actorcore as ac

    options = {k: v for ask in pair for k, v in (ASKS.get(ask) or {}).items()}
    if parallel is not None:
        options["parallel"] = parallel
    invariant = "batch_invariant" in pair
    handle = ac.patch_model(model, **options)
    device = next(model.parameters()).device
    try:
        trace = Counter()
        batch = ac.pack([s.to(device) for s in seqs])
        out = ac.compute_logprobs(model, batch, temperature=TEMPERATURE, batch_invariant=invariant, parallel=parallel,
                                  trace=trace)
        (out.log_probs * _weights(out.log_probs.numel(), device)).sum().backward()
        if parallel is not None:
            for p in model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=parallel.sp_group)
                    p.grad /= parallel.sp_size
            assert trace["attention:actorcore_ulysses"] >= 1, f"{pair}: Ulysses attention did not run"
        grads = _grads(model)
        worst = (out.log_probs.float() - want.log_probs).abs().max().item()
        assert worst <= tol.log_prob, f"{pair}: log-probs differ from the model's own fp32 forward by {worst:.2e}"
        assert grads.keys() == want.grads.keys(), f"{pair}: gradients of other parameters"
        for name, ref in want.grads.items():
            rel = _relative(grads[name] - ref, ref, tol.grad_by_norm)
            allowed = tol.grad_allowance(name, ref)
            assert rel <= allowed, f"{pair}: {name}'s gradient differs by {rel:.2e} (relative; allowed {allowed:.2e})"
        for ask in pair:
            feature = FEATURE.get(ask, "packed_attention")
            key = f"plan:stood_down:{feature}" if invariant and ask in STANDS_DOWN else f"plan:{feature}"
            assert trace[key] == 1, f"{pair}: the trace has no {key}: {sorted(k for k in trace if 'plan:' in k)}"
            backend = (ASKS.get(ask) or {}).get("attention_backend")
            layers = len(handle.parts.attention_layers)
            assert backend is None or trace[f"varlen_attention:{backend}"] >= layers, \
                f"{pair}: {backend} ran {trace[f'varlen_attention:{backend}']} times for {layers} attention layers"
        if invariant:
            with torch.no_grad():
                alone = ac.compute_logprobs(model, ac.pack([seqs[0].to(device)]), temperature=TEMPERATURE,
                                            batch_invariant=True, parallel=parallel).log_probs
            assert torch.equal(alone, out.log_probs[:len(seqs[0])].detach()), f"{pair}: not batch-invariant"
        return trace
    finally:
        handle.revert()
        model.zero_grad(set_to_none=True)
