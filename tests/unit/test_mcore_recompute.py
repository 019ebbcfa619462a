"""The Megatron route's recompute options and budget planner (``mcore/build/recompute.py``), pure functions: the requests
it refuses, each layer's mode at budgets from nothing to everything, measured bytes taking over from the estimate,
and the micro-batches a pipeline stage holds at once. (The layers running those modes, with bitwise the gradients of
no recompute: tests/dist/test_mcore_speed.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actorcore.mcore.build.recompute import (FULL, NONE, SELECTIVE, SLACK_BYTES, RecomputePlan, check_recompute,
                                       check_recompute_config, layer_bytes_per_token, micro_batches_in_flight,
                                       plan_layer_modes)

GIB = 2**30


def _config(**overrides):
    base = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=88,
                multi_latent_attention=False, moe_router_topk=2, moe_ffn_hidden_size=40, num_moe_experts=4,
                moe_shared_expert_intermediate_size=None, recompute_granularity=None, hidden_dropout=0.0,
                attention_dropout=0.0)
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("mode,budget,message", [
    (None, 40, "recompute='auto'"), ("full", 40, "only used by recompute='auto'"), ("auto", None, "positive number"),
    ("auto", True, "positive number"), ("auto", -1, "positive number"), ("auto", float("nan"), "positive number"),
    ("sometimes", None, "must be None"), (True, None, "must be None"),
])
def test_refuses_requests_that_do_not_fit_together(mode, budget, message):
    with pytest.raises(ValueError, match=message):
        check_recompute(mode, budget)


def test_plans_of_accepted_requests():
    assert check_recompute(None, None) is None
    assert check_recompute("selective", None) == RecomputePlan("selective")
    assert check_recompute("auto", 1.5) == RecomputePlan("auto", 1.5 * GIB)


def test_refuses_megatrons_own_recompute_and_dropout():
    plan = RecomputePlan("full")
    with pytest.raises(ValueError, match="recompute_granularity"):
        check_recompute_config(plan, _config(recompute_granularity="full"))
    with pytest.raises(ValueError, match="dropout"):
        check_recompute_config(plan, _config(attention_dropout=0.1))
    check_recompute_config(None, _config(attention_dropout=0.1))  # no recompute: dropout as the model has it


def test_estimates_keep_more_without_recompute_and_count_the_experts():
    config = _config()
    dense_none, dense_selective, dense_input = layer_bytes_per_token(config, 2, moe=False)
    moe_none, moe_selective, moe_input = layer_bytes_per_token(config, 2, moe=True)
    assert 0 < dense_selective < dense_none and 0 < moe_selective < moe_none
    assert dense_input == moe_input == 64 * 2
    wider = layer_bytes_per_token(_config(moe_router_topk=4), 2, moe=True)
    assert wider[0] > moe_none and wider[1] > moe_selective  # twice the routed rows
    local_none, local_selective, local_input = layer_bytes_per_token(config, 2, moe=True, local_experts=True)
    assert dense_selective < local_selective < moe_selective and local_none < moe_none and local_input == moe_input


def _layers(n: int) -> list[tuple[float, float, float]]:
    return [(300.0, 100.0, 10.0)] * n  # bytes per token: kept without recompute, kept selectively, the input


def test_auto_fills_the_budget_from_the_last_layer():
    layers, tokens = _layers(6), 1000
    base = SLACK_BYTES + 6 * 10.0 * tokens
    plan = lambda budget: plan_layer_modes(RecomputePlan("auto", budget), layers, tokens, 1, 0.0)  # noqa: E731
    assert plan(base) == [FULL] * 6  # nothing fits
    assert plan(base + 3 * 100.0 * tokens) == [FULL] * 4 + [SELECTIVE] * 2  # two selective layers cost three
    assert plan(base + 7 * 100.0 * tokens) == [SELECTIVE] * 6  # all selective; no room to keep everything of one
    assert plan(base + 11 * 100.0 * tokens) == [SELECTIVE] * 5 + [NONE]  # its 300 at its peak, twice
    assert plan(base + 100 * 300.0 * tokens) == [NONE] * 6
    modes = [plan(base + k * 50.0 * tokens) for k in range(0, 60)]
    order = {FULL: 0, SELECTIVE: 1, NONE: 2}
    for fewer, more in zip(modes, modes[1:]):  # a larger budget never recomputes more
        assert all(order[a] <= order[b] for a, b in zip(fewer, more))
        assert all(order[a] <= order[b] for a, b in zip(more, more[1:]))  # the kept layers are the last


def test_full_and_selective_ignore_the_budget():
    assert plan_layer_modes(RecomputePlan("full"), _layers(3), 10**6, 1, 0.0) == [FULL] * 3
    assert plan_layer_modes(RecomputePlan("selective"), _layers(3), 10**6, 1, 0.0) == [SELECTIVE] * 3


def test_measured_bytes_take_over_and_micro_batches_in_flight_count():
    layers, tokens = _layers(4), 1000
    budget = SLACK_BYTES + 4 * 10.0 * tokens + 5 * 100.0 * tokens
    auto = RecomputePlan("auto", budget)
    assert plan_layer_modes(auto, layers, tokens, 1, 0.0) == [SELECTIVE] * 4
    measured = {(3, SELECTIVE): 400.0}  # the last layer keeps more than estimated
    assert plan_layer_modes(auto, layers, tokens, 1, 0.0, measured) == [FULL] * 4
    assert plan_layer_modes(auto, layers, tokens, 2, 0.0)[:2] == [FULL, FULL]  # two micro-batches alive: less room
    assert plan_layer_modes(auto, layers, tokens, 1, budget) == [FULL] * 4  # the budget already allocated


def test_a_single_micro_batch_counts_the_gradients_its_backward_allocates():
    """In a call of one micro-batch the gradients come as backward goes: by a layer's backward its own, the later
    layers' and the output layer's; by the first layer's, all of them (where a fully recomputed layer runs)."""
    layers, tokens = _layers(4), 1000
    grad = 10.0 * tokens  # each layer's weight gradients
    room = SLACK_BYTES + 4 * 10.0 * tokens + 5 * 100.0 * tokens + grad
    auto = RecomputePlan("auto", room)
    # At the last layer's backward (the peak: all four kept, its own activation gradients) only its own are there.
    assert plan_layer_modes(auto, layers, tokens, 1, 0.0, grads_from=[4 * grad, 3 * grad, 2 * grad, grad]) == \
        [SELECTIVE] * 4
    # Were they all there from the start (the output layer's are): one layer less.
    assert plan_layer_modes(auto, layers, tokens, 1, 0.0, grads_from=[4 * grad] * 4) == [FULL] + [SELECTIVE] * 3
    with pytest.warns(UserWarning, match="cannot be met"):  # no room for a recompute beside all of them
        tight = RecomputePlan("auto", SLACK_BYTES + 4 * 10.0 * tokens + 3 * 100.0 * tokens + grad)
        assert plan_layer_modes(tight, layers, tokens, 1, 0.0, grads_from=[4 * grad, 3 * grad, 2 * grad, grad]) == \
            [FULL] * 4
    assert plan_layer_modes(tight, layers, tokens, 1, 0.0)[-2:] == [SELECTIVE] * 2  # not counting them: two kept


def test_micro_batches_in_flight():
    assert micro_batches_in_flight(1, 0, None, 8) == 1
    assert [micro_batches_in_flight(4, rank, None, 8) for rank in range(4)] == [4, 3, 2, 1]
    assert micro_batches_in_flight(4, 3, None, 2) == 1 and micro_batches_in_flight(4, 0, None, 2) == 2
    assert micro_batches_in_flight(2, 1, 2, 8) == 4


def test_a_layer_built_alike_stands_in_for_a_mode_a_layer_has_not_run():
    """The last layer kept whole measured 150 bytes per token against the 300 estimated: layers of its kind plan
    with that before they run unrecomputed themselves (without kinds each waits for its own measurement); a layer
    of another kind keeps its estimate."""
    layers, tokens = _layers(6), 1000
    base = SLACK_BYTES + 6 * 10.0 * tokens
    auto = RecomputePlan("auto", base + 11 * 100.0 * tokens)
    measured = {(5, NONE): 150.0}
    own_only = [SELECTIVE] * 4 + [NONE] * 2
    assert plan_layer_modes(auto, layers, tokens, 1, 0.0, measured) == own_only
    assert plan_layer_modes(auto, layers, tokens, 1, 0.0, measured, kinds=["dense"] * 6) == [NONE] * 6
    assert plan_layer_modes(auto, layers, tokens, 1, 0.0, measured, kinds=["moe"] * 5 + ["dense"]) == own_only


def test_gradients_to_come_count_what_backward_will_allocate():
    """A call of several micro-batches plans with the gradients its first backward allocates: parameters without a
    ``grad`` or a ``main_grad`` buffer, at their dtype; frozen parameters none."""
    import torch

    from actorcore.mcore.run.call_plan import gradient_bytes_to_come, gradients_from, resident_bytes

    layers = [torch.nn.Linear(8, 4, dtype=torch.bfloat16), torch.nn.Linear(4, 2), torch.nn.Linear(2, 3),
              torch.nn.Linear(3, 5)]
    layers[1].weight.grad = torch.zeros_like(layers[1].weight)  # allocated already
    layers[2].weight.main_grad = torch.zeros(3, 2)  # Megatron's gradient buffer, allocated already
    layers[3].requires_grad_(False)
    model = SimpleNamespace(chunks=[torch.nn.ModuleList(layers[:2]), torch.nn.ModuleList(layers[2:])],
                            device=torch.device("cpu"))
    assert gradient_bytes_to_come(model) == (8 * 4 + 4) * 2 + 2 * 4 + 3 * 4
    assert resident_bytes(model, 2) == 0  # off CUDA: no allocator to ask, nothing counted
    # Per decoder layer (here the middle two), from its backward on: its own and the later ones', and the rest
    # (the first and last modules') from the start.
    rest = (8 * 4 + 4) * 2
    assert gradients_from(model, layers[1:3]) == [rest + 2 * 4 + 3 * 4, rest + 3 * 4]
