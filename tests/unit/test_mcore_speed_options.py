"""The Megatron route's speed options resolve as documented and refuse what cannot run, with the reason
(``mcore/build/grouped_experts.py``'s ``moe_experts``, ``mcore/build/layer.py``'s ``compiled_layers``): on this CPU machine
``"auto"`` takes the grouped experts and leaves the layers eager; quack is refused without a Hopper GPU; a config the
grouped experts or the compiled layers do not cover falls back under ``"auto"`` and is refused when asked for."""

from __future__ import annotations

import pytest
import torch

import actorcore.kernels.quack.runtime as quack_runtime

pytest.importorskip("megatron.core")


def _config(model_type: str, **overrides):
    from actorcore.mcore.build.config import hf_to_mcore_config
    from actorcore.testing.tiny_configs import tiny_config

    return hf_to_mcore_config(tiny_config(model_type), **overrides)


def test_moe_experts_resolve_and_refuse():
    from actorcore.mcore.build.grouped_experts import resolve_moe_experts

    config = _config("qwen3_moe")
    assert resolve_moe_experts("auto", config, torch.float32) == "grouped"
    assert resolve_moe_experts("grouped", config, torch.bfloat16) == "grouped"
    assert resolve_moe_experts("sequential", config, torch.float32) == "sequential"
    assert resolve_moe_experts("auto", _config("qwen3"), torch.float32) is None  # no MoE layers
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="moe_experts='quack': .*Hopper.*'sequential'"):
            resolve_moe_experts("quack", config, torch.bfloat16)
    for bad in ("fast", True, None):
        with pytest.raises(ValueError, match="moe_experts must be one of"):
            resolve_moe_experts(bad, config, torch.float32)


def test_experts_the_grouped_path_does_not_cover_stay_megatrons():
    from actorcore.mcore.build.grouped_experts import resolve_moe_experts

    config = _config("qwen3_moe", moe_grouped_gemm=True)
    assert resolve_moe_experts("auto", config, torch.float32) == "sequential"
    with pytest.raises(ValueError, match="moe_grouped_gemm=True"):
        resolve_moe_experts("grouped", config, torch.float32)


def test_quack_covers_swiglu_experts_only(monkeypatch):
    """Where quack runs (its probe answered yes here), "auto" takes it for bf16 SwiGLU experts, and the reasons it
    does not cover the others are named."""
    import actorcore.mcore.build.grouped_experts as grouped_experts

    monkeypatch.setattr(quack_runtime, "quack_refusal", lambda: None)
    qwen3_moe = _config("qwen3_moe")
    assert grouped_experts.resolve_moe_experts("auto", qwen3_moe, torch.bfloat16) == "quack"
    assert grouped_experts.resolve_moe_experts("auto", qwen3_moe, torch.float32) == "grouped"
    assert "torch.float32, not bf16" in grouped_experts.quack_experts_refusal(qwen3_moe, torch.float32)
    assert "not SwiGLU" in grouped_experts.quack_experts_refusal(_config("gpt_oss"), torch.bfloat16)
    odd = _config("qwen3_moe", moe_ffn_hidden_size=44)
    assert "intermediate=44" in grouped_experts.quack_experts_refusal(odd, torch.bfloat16)
    assert grouped_experts.resolve_moe_experts("auto", odd, torch.bfloat16) == "grouped"


def test_compiled_layers_resolve_and_refuse():
    from actorcore.mcore.build.layer import resolve_compiled_layers

    config = _config("qwen3_moe")
    assert resolve_compiled_layers("auto", config, torch.float32) is False  # fp32 stays eager
    assert resolve_compiled_layers(True, config, torch.float32) is True
    assert resolve_compiled_layers(False, config, torch.bfloat16) is False
    if not torch.cuda.is_available():
        assert resolve_compiled_layers("auto", config, torch.bfloat16) is False  # CUDA only under "auto"
    dropout = _config("qwen3_moe", hidden_dropout=0.1)
    assert resolve_compiled_layers("auto", dropout, torch.bfloat16) is False
    with pytest.raises(ValueError, match="hidden_dropout=0.1"):
        resolve_compiled_layers(True, dropout, torch.float32)
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="compiled_layers must be True, False or 'auto'"):
            resolve_compiled_layers(bad, config, torch.float32)


def test_a_compiled_region_dynamo_runs_uncompiled_is_refused(monkeypatch):
    """The compiled layers' regions (``fused_ops.compiled``): past Dynamo's recompile limit torch.compile would run
    them uncompiled with only a log line. With room for one graph, the second variant (gradients off) raises; with
    room for two it compiles, per element the eager function."""
    import actorcore.kernels.compiled_graphs as compiled_graphs
    from actorcore.errors import PatchNotAppliedError
    from actorcore.mcore.build import fused_ops

    def shifted_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * w) + 1

    x, w = torch.randn(5, 4), torch.full((4,), 0.5, requires_grad=True)
    for room in (1, 2):
        monkeypatch.setattr(compiled_graphs, "VARIANTS_LIMIT", room)
        torch._dynamo.reset()
        fused_ops.compiled.cache_clear()
        region = fused_ops.compiled(shifted_relu)
        with torch._dynamo.config.patch(recompile_limit=1):  # a config module: monkeypatch would delete it after
            assert torch.equal(region(x, w), shifted_relu(x, w))  # the first graph
            with torch.no_grad():
                if room == 1:
                    with pytest.raises(PatchNotAppliedError, match="compiled shifted_relu ran no compiled graph"):
                        region(x, w)
                else:
                    assert torch.equal(region(x, w), shifted_relu(x, w))
    torch._dynamo.reset()
    fused_ops.compiled.cache_clear()


@pytest.mark.parametrize("tokens,experts,top_k", [(13, 6, 2), (1, 4, 1), (40, 8, 8), (7, 128, 8)])
def test_gather_dispatch_moves_rows_as_megatron_permute_and_unpermute(tokens, experts, top_k):
    """The gather-only dispatcher's rows are megatron-core's (``moe_utils.permute``: by expert, tokens ascending);
    forward and backward equal megatron's ``permute`` / ``unpermute`` (fp32: its scatter-add sums K rows in another
    order)."""
    from megatron.core.transformer.moe.moe_utils import permute as megatron_permute
    from megatron.core.transformer.moe.moe_utils import unpermute as megatron_unpermute

    from actorcore.kernels.moe_permute import combine, permute
    from actorcore.mcore.build.gather_dispatch import expert_order

    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=gen) * routing_map
    x = torch.randn(tokens, 5, generator=gen, requires_grad=True)
    grad = torch.randn(tokens * top_k, 5, generator=gen)

    want_rows, want_probs, sorted_indices = megatron_permute(x, routing_map, probs=probs)
    want_out = megatron_unpermute(want_rows * 3, sorted_indices, x.shape)
    (want_grad,) = torch.autograd.grad((want_rows * grad).sum() + want_out.square().sum(), x)

    order = expert_order(routing_map, top_k)
    rows = permute(x, order)
    got_probs = probs.reshape(-1).index_select(0, order.token_of_row * experts + order.expert_of_row)
    out = combine(rows * 3, torch.ones(tokens, top_k), order, x.dtype)
    (got_grad,) = torch.autograd.grad((rows * grad).sum() + out.square().sum(), x)
    assert torch.equal(order.token_of_row, sorted_indices) and torch.equal(rows, want_rows)
    assert torch.equal(got_probs, want_probs)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_fused_qk_norms_cover_one_ranks_whole_query_groups_only():
    """``mcore/build/qk_norm.py`` fuses the q/k norms of megatron-core's ``SelfAttention`` where a rank holds whole
    query groups, the attention has q and k norms and no output gate; elsewhere Megatron's code runs, and says why."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    from actorcore.mcore.build.qk_norm import FusedQkNormAttention, qk_norm_refusal, use_fused_qk_norms

    def attention(world_size=1, norms=True, **overrides):
        module = SelfAttention.__new__(SelfAttention)
        torch.nn.Module.__init__(module)
        module.config, module.world_size = _config("qwen3", **overrides), world_size
        module.q_layernorm = module.k_layernorm = torch.nn.RMSNorm(8) if norms else None
        return module

    plain = attention()
    assert qk_norm_refusal(plain) is None and use_fused_qk_norms(plain) and type(plain) is FusedQkNormAttention
    groups = plain.config.num_query_groups
    assert "all-gather" in qk_norm_refusal(attention(world_size=2 * groups))
    assert qk_norm_refusal(attention(norms=False)) == "no q/k norms"
    identity = attention()
    identity.q_layernorm = identity.k_layernorm = IdentityOp()  # the local spec's norms without qk_layernorm
    assert qk_norm_refusal(identity) == "no q/k norms"
    assert qk_norm_refusal(attention(attention_output_gate=True)) == "an attention output gate"
    assert "other than megatron-core's SelfAttention" in qk_norm_refusal(torch.nn.Linear(2, 2))
    refused = attention(norms=False)
    assert not use_fused_qk_norms(refused) and type(refused) is SelfAttention


def test_the_head_takes_the_output_weight_itself_where_it_has_no_padding_rows():
    """The head's weight is the parameter (its gradient lands in ``.grad`` as formed), a slice only where the
    vocabulary is padded: a slice's backward copies the ``[V, D]`` gradient into a new zero-filled tensor."""
    from types import SimpleNamespace

    from actorcore.mcore.run.forward import _output_weight_shard

    weight = torch.nn.Parameter(torch.randn(8, 4))
    chunk = SimpleNamespace(share_embeddings_and_output_weights=False, output_layer=SimpleNamespace(weight=weight))
    whole, start = _output_weight_shard(chunk, 8, SimpleNamespace(tp_rank=0))
    assert whole is weight and start == 0
    padded, _ = _output_weight_shard(chunk, 6, SimpleNamespace(tp_rank=0))
    assert padded.shape == (6, 4) and padded._base is weight
    second_rank, start = _output_weight_shard(chunk, 13, SimpleNamespace(tp_rank=1))
    assert start == 8 and second_rank.shape == (5, 4)
