"""What FSDP2 holds beside a call's activations (``parallel.fsdp_memory``), on 2 gloo processes: the whole copies of
each sharding layout, counted from the model's parameter sizes (not from FSDP2's state, which the count reads), and
``checkpointing="auto"`` planning with them: a budget with room for three kept layers beside FSDP2's copies keeps
three in the call, where the same budget without them would keep more."""

import contextlib
from collections import Counter

import pytest
import torch

from actorcore.testing.distributed import run_distributed

LAYERS = 6
KEPT = 3  # layers the budget keeps beside FSDP2's copies


def _batch(rank):
    import actorcore as ac

    g = torch.Generator().manual_seed(60 + rank)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (21, 9)])


def _sharded(layout):
    """A tiny llama (untied head but in "tied head") sharded by FSDP2 in ``layout``; its sizes in elements (a layer,
    the head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from actorcore.testing.tiny_configs import build_tiny_model

    tied = layout == "tied head"  # the head is the embedding (Qwen2.5-1.5B): one weight in the root's group
    model = build_tiny_model("llama", seed=3, num_hidden_layers=LAYERS, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    sizes = (sum(p.numel() for p in model.model.layers[0].parameters()), model.lm_head.weight.numel())
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if layout == "bf16" else {}
    if layout != "root only":
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=layout != "layers held", **kw)
    if layout == "head apart":
        fully_shard(model.lm_head)
    fully_shard(model, **kw)
    return model, sizes


def _counted_in_forward(model, state_unreadable=False):
    """``fsdp_gathered_bytes`` as a call reads it: inside the model's forward (FSDP2's root gathered).
    ``state_unreadable``: as under a torch whose FSDP2 state is not where the count reads it."""
    from unittest import mock

    from torch.distributed.fsdp import FSDPModule

    from actorcore.parallel.fsdp_memory import fsdp_gathered_bytes

    seen = []

    def read(module, args, kwargs):
        gone = mock.patch.object(FSDPModule, "_get_fsdp_state", side_effect=AttributeError("moved"))
        with gone if state_unreadable else contextlib.nullcontext():
            seen.append(fsdp_gathered_bytes(model, list(model.model.layers), model.lm_head.weight))

    hook = model.model.register_forward_pre_hook(read, with_kwargs=True)
    try:
        model(torch.arange(3, 11)[None]).logits.sum().backward()
    finally:
        hook.remove()
    return seen[0]


def _planned(config, tokens, budget_bytes, fsdp_bytes):
    """The kept-layer count the planner gives this rank's call with FSDP2's copies counted as given (a later
    micro-batch: the gradient shards there; the head's gradient held whole: no tail)."""
    from actorcore.hf.features.checkpointing import CallShape, CheckpointPlan, mean_context, plan_layer_modes

    shape = CallShape(tokens, 4, 0.0, mean_context(_batch(torch.distributed.get_rank()).cu_seqlens), (), 0.0,
                      (0.0,) * LAYERS, 0.0, fsdp_bytes)
    return plan_layer_modes(CheckpointPlan("auto", budget_bytes), [False] * LAYERS, shape, config).count("selective")


def _worker(rank, world_size):
    import actorcore as ac
    from actorcore.hf.features.checkpointing import FULL_LAYERS, SELECTIVE_LAYERS
    from actorcore.testing.tiny_configs import tiny_config

    counted = {}
    for layout in ("per layer", "head apart", "bf16", "layers held", "root only", "tied head"):
        model, sizes = _sharded(layout)
        counted[layout] = (_counted_in_forward(model), sizes)
    counted["defaults"] = (_counted_in_forward(_sharded("per layer")[0], state_unreadable=True), sizes)
    model, sizes = _sharded("per layer")
    model.set_requires_gradient_sync(False)  # micro-batches that do not reduce: whole gradients kept across them
    counted["no sync"] = (_counted_in_forward(model), _counted_in_forward(model))

    # The budget: the least that keeps KEPT layers without FSDP2's copies (the planner's own search), plus the copies:
    # two layers' parameters, the gradients of one and their reduce-scatter input, the head's gradient held whole.
    layer, head = counted["per layer"][1]
    config = tiny_config("llama", num_hidden_layers=LAYERS)
    tokens = _batch(rank).num_tokens
    fsdp = 4 * layer * 4 + head * 4
    low, high = 2.0**30, 2.0**31
    while high - low > 1.0:
        mid = (low + high) / 2
        low, high = (low, mid) if _planned(config, tokens, mid, 0.0) >= KEPT else (mid, high)
    budget = high + fsdp
    plans = (_planned(config, tokens, budget, fsdp), _planned(config, tokens, budget, 0.0))

    model = _patched_then_sharded(budget)
    model.train()
    trace = Counter()
    out = ac.compute_logprobs(model, _batch(rank), trace=trace)
    out.log_probs.sum().backward()
    return {"counted": counted, "plans": plans, "ran": (trace[FULL_LAYERS], trace[SELECTIVE_LAYERS])}


def _patched_then_sharded(budget_bytes):
    """The "per layer" model with ``checkpointing="auto"`` at ``budget_bytes``, patched before it is sharded."""
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("llama", seed=3, num_hidden_layers=LAYERS)
    ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget_bytes / 2**30)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for param in model.parameters():  # a later micro-batch: the gradient shards are there
        param.grad = torch.zeros_like(param)
    return model


@pytest.mark.dist
def test_fsdp2_copies_are_counted_and_planned_around():
    for rank, r in enumerate(run_distributed(_worker, 2)):
        c = r["counted"]
        per_layer, (layer, head) = c["per layer"]
        four = 4  # fp32
        assert per_layer.window == 4 * layer * four and per_layer.held == head * four, per_layer
        assert per_layer.tail == 0 and per_layer.head_gradient_held and per_layer.compute_element_bytes == four
        apart = c["head apart"][0]  # the head reshards: gathered again for its backward, its gradient reduced then
        assert apart.held == 0 and apart.tail == head * four and not apart.head_gradient_held, apart
        bf16 = c["bf16"][0]
        assert bf16.window == 4 * layer * 2 and bf16.held == head * 2 and bf16.compute_element_bytes == 2, bf16
        held = c["layers held"][0]  # not resharded after forward: every layer's parameters from its forward on
        assert held.held == LAYERS * layer * four + head * four and held.window == 2 * layer * four, held
        tied = c["tied head"][0]  # the embedding's weight: its gradient from the head's backward on, whole
        assert tied == per_layer, (tied, per_layer)
        assert c["defaults"][0] == per_layer  # FSDP2's defaults assumed: what this layout is
        first, later = c["no sync"]  # the layers' whole gradients to come, then there; the head's kept from the first
        assert first.layer_gradients == (layer * four,) * LAYERS and first.window == 2 * layer * four, first
        assert first.head_gradient_held and first.held == head * four, first
        assert later.layer_gradients == (0.0,) * LAYERS and not later.head_gradient_held and later.held == 0, later
        root = c["root only"][0]  # one group, gathered already; the layers' whole gradients are the ones to come
        assert root.held == head * four and root.window == 0, root
        # the copies counted: KEPT layers kept; not counted, the same budget would keep more
        assert r["plans"][0] == KEPT < r["plans"][1], r["plans"]
        assert r["ran"] == (LAYERS - KEPT, KEPT), r["ran"]


def _resharded_to_two(rank, world_size):
    """4 ranks, the layers resharded to 2 ranks after forward: each holds half its parameters until its backward."""
    from torch.distributed.fsdp import fully_shard

    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("llama", seed=3, num_hidden_layers=LAYERS)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=2)
    fully_shard(model)
    return (_counted_in_forward(model), sum(p.numel() for p in model.model.layers[0].parameters()),
            model.lm_head.weight.numel())


@pytest.mark.dist
def test_layers_resharded_to_fewer_ranks_hold_their_share():
    for rank, (counted, layer, head) in enumerate(run_distributed(_resharded_to_two, 4)):
        assert counted.held == LAYERS * layer * 4 / 2 + head * 4, (rank, counted)
        assert counted.window == 4 * layer * 4, (rank, counted)
