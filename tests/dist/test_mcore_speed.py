"""The Megatron route's speed paths on gloo (2 CPU processes, one spawn for every case): the grouped experts
(``mcore/build/grouped_experts.py``), the compiled layers (``mcore/build/layer.py``) and the budgeted recompute
(``mcore/build/recompute.py``).

- Grouped experts at EP=2, TP=2 and TP=2 x EP=2 for every MoE family of the route (Qwen3-MoE, Qwen2-MoE with one
  expert per token, Mixtral, DeepSeek-V3, GLM-4.5, gpt-oss with its biases and clamped SwiGLU, the hybrids Qwen3-Next
  and Qwen3.5-MoE): per-token log-probs and entropy, and every parameter's gradient after Megatron's DDP and
  ``finalize_model_grads``, against the model's own transformers forward in fp32; each case proves the grouped
  experts ran (its trace) and read their weights in place (consecutive in memory, under Megatron's DDP).
- A distributed checkpoint saved with the grouped experts loads into megatron-core's sequential experts and back,
  and both export the HF checkpoint bit-exact; their sharded state dicts hold the same keys; their log-probs and
  gradients agree to fp32 summation order. Called directly on rows per expert with an expert without rows, one
  with a single row and a rank without any, the grouped experts (Qwen3-MoE; gpt-oss with biases and the clamped
  SwiGLU) equal the sequential ones per element, output and every gradient.
- Recompute "full", "selective" and "auto" (a budget that keeps one layer's activations and recomputes the other
  selectively) give bitwise the gradients and log-probs of no recompute, at TP=2 x EP=2 (the all-to-alls and the
  sequence-parallel gathers inside the checkpoints); the compiled layers (compiled by Inductor on the CPU, fp32) equal
  the eager ones per token and per gradient within fp32 reduction order, and under the selective checkpoint
  bitwise their own gradients without it. Each run's trace proves the modes and the fused regions ran.

The same model's bf16 numerics on the GPU: tests/gpu/test_mcore_speed_cuda.py.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.testing.tolerances import TOL


pytest.importorskip("megatron.core")

# Every MoE family of the Megatron route at one layout (Qwen3-MoE at all three): (model_type, tp, ep, HF overrides).
FAMILY_CASES = {
    "qwen3_moe_ep2": ("qwen3_moe", 1, 2, {}),
    "qwen3_moe_tp2": ("qwen3_moe", 2, 1, {}),
    "qwen3_moe_tp2_ep2": ("qwen3_moe", 2, 2, {}),
    "qwen2_moe_tp2_ep2_top1": ("qwen2_moe", 2, 2, {"num_experts_per_tok": 1}),
    "mixtral_ep2": ("mixtral", 1, 2, {}),
    "deepseek_v3_tp2_ep2": ("deepseek_v3", 2, 2, {}),
    "glm4_moe_ep2": ("glm4_moe", 1, 2, {}),
    "gpt_oss_ep2": ("gpt_oss", 1, 2, {}),
    "qwen3_next_tp2_ep2": ("qwen3_next", 2, 2, {}),
    "qwen3_5_moe_text_ep2": ("qwen3_5_moe_text", 1, 2, {}),
}
TWO_TOKENS = [torch.tensor([5, 9])]  # a batch of one short sequence (one token per rank under sequence parallelism)
# Rows per local expert handed to the experts directly (EP=2: two local experts): an expert without rows, one with a
# single row, a rank without any.
EDGE_ROWS = ([0, 1], [1, 0], [0, 0], [3, 1])


def _sequences() -> list[list[torch.Tensor]]:
    from support.mcore_logprobs import logprob_sequences

    return logprob_sequences() + [TWO_TOKENS]


def _batches():
    import actorcore as ac

    return [ac.pack(sequences) for sequences in _sequences()]


def _family_case(model_type: str, tp: int, ep: int, overrides: dict, directory: str) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from support.mcore_logprobs import tiny_hf, reference_logprobs_packed
    from support.mcore_moe_tp import grads_as_hf

    from actorcore.kernels.grouped_gemm import consecutive
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.build.grouped_experts import GroupedExperts
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    hf = tiny_hf(model_type, **overrides)
    parallel = McoreParallel(tp=tp, ep=ep)
    initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel)  # "auto": the grouped experts on the CPU
    load_hf_into_mcore(model, directory)
    wrapped = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk) for chunk in model.chunks]
    in_place = [consecutive(m.expert_tensors(name)) for chunk in model.chunks for m in chunk.modules()
                if isinstance(m, GroupedExperts) for name in ("linear_fc1.weight", "linear_fc2.weight")]
    trace = Counter()
    batches = _batches()
    got = compute_logprobs(model, batches, trace=trace)
    fb = compute_logprobs(model, batches, loss_fn=lambda out, batch: -out.log_probs.sum(), trace=trace)
    finalize_model_grads(wrapped)
    with torch.no_grad():
        ref = [reference_logprobs_packed(hf, sequences) for sequences in _sequences()]
    hf.zero_grad()
    for sequences in _sequences():
        (reference_logprobs_packed(hf, sequences)[0].sum() * (-1.0 / len(batches))).backward()
    return {"got": [(o.log_probs, o.entropy) for o in got], "fb": [o.log_probs for o in fb], "ref": ref,
            "grads": grads_as_hf(model), "ref_grads": {n: p.grad for n, p in hf.named_parameters() if p.grad is not None},
            "experts": model.moe_experts, "trace": dict(trace), "in_place": in_place}


def _train_step(model, batches, trace: Counter) -> tuple[list, dict]:
    """Forward-backward of the summed log-probs; (log-probs, every parameter's local gradient by name)."""
    from actorcore.mcore.run.forward import compute_logprobs

    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)
    out = compute_logprobs(model, batches, loss_fn=lambda o, b: -o.log_probs.sum(), trace=trace)
    grads = {f"{i}.{name}": p.grad.clone() for i, chunk in enumerate(model.chunks)
             for name, p in chunk.named_parameters() if p.grad is not None}
    return [o.log_probs for o in out], grads


def _checkpoint_swap_case(directory: str, root: str) -> dict:
    """EP=2: grouped -> distributed checkpoint -> sequential -> checkpoint -> grouped, each exporting the HF
    checkpoint; the two kernels' sharded keys, log-probs and gradients."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from actorcore.mcore.convert.dist_checkpoint import load_mcore_checkpoint, save_mcore_checkpoint
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict

    parallel = McoreParallel(ep=2)
    initialize_megatron(parallel)
    config = AutoConfig.from_pretrained(directory)
    grouped = build_gpt_model(config, parallel, moe_experts="grouped")
    load_hf_into_mcore(grouped, directory)
    first, second = os.path.join(root, "from_grouped"), os.path.join(root, "from_sequential")
    save_mcore_checkpoint(grouped, first, directory)
    dist.barrier()
    sequential = build_gpt_model(config, parallel, moe_experts="sequential")
    load_mcore_checkpoint(sequential, first)
    exported = {"sequential": gather_hf_state_dict(sequential)}
    save_mcore_checkpoint(sequential, second, directory)
    dist.barrier()
    back = build_gpt_model(config, parallel, moe_experts="grouped")
    load_mcore_checkpoint(back, second)
    exported["grouped"] = gather_hf_state_dict(back)
    keys = {name: sorted(model.chunks[0].sharded_state_dict().keys()) for name, model in
            (("grouped", back), ("sequential", sequential))}
    types = {name: type(model.chunks[0].decoder.layers[0].mlp.experts).__name__ for name, model in
             (("grouped", back), ("sequential", sequential))}
    batches = _batches()
    steps = {name: _train_step(model, batches, Counter()) for name, model in (("grouped", back),
                                                                               ("sequential", sequential))}
    return {"exported": exported, "keys": keys, "types": types, "steps": steps}


def _selective_and_kept_budget(model, batches) -> float:
    """A budget in GiB under which ``"auto"`` keeps the last layer's activations whole and recomputes the first one's
    elementwise work (from the planner's own estimate on the CPU, where nothing is allocated)."""
    from actorcore.mcore.run.call_plan import _is_moe, decoder_layers
    from actorcore.mcore.build.recompute import SLACK_BYTES, layer_bytes_per_token

    layers = decoder_layers(model)
    estimates = [layer_bytes_per_token(model.config, 4, _is_moe(layer)) for layer in layers]
    tokens = max(b.num_tokens for b in batches) // model.context.tp_size
    (_, first_selective, _), (last_none, _, _) = estimates
    base = SLACK_BYTES + sum(e[2] for e in estimates) * tokens
    # layers_to_keep's rule: the kept layers' peak (the last one's bytes twice, then the first one's on top), and
    # room for three of the largest kept layer
    room = max(2 * last_none + first_selective, 3 * max(first_selective, last_none)) * tokens
    return (base + room * 1.001) / 2**30


def _recompute_case(directory: str) -> dict:
    """TP=2 x EP=2, Qwen3-MoE (a MoE and a dense layer): one training step per recompute mode and fused choice."""
    from transformers import AutoConfig

    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(tp=2, ep=2)
    initialize_megatron(parallel)
    config = AutoConfig.from_pretrained(directory)
    batches = _batches()
    reference = build_gpt_model(config, parallel)
    budget = _selective_and_kept_budget(reference, batches)
    variants = {"none": {}, "full": dict(recompute="full"), "selective": dict(recompute="selective"),
                "auto": dict(recompute="auto", memory_budget_gib=budget), "fused": dict(compiled_layers=True),
                "fused_selective": dict(compiled_layers=True, recompute="selective")}
    out = {}
    for name, options in variants.items():
        model = build_gpt_model(config, parallel, **options)
        load_hf_into_mcore(model, directory)
        trace = Counter()
        out[name] = (*_train_step(model, batches, trace), dict(trace), model.compiled_layers)
    return out


def _edge_rows_case(directories: dict[str, str]) -> dict:
    """EP=2: the first MoE layer's experts called directly, grouped and megatron-core's sequential ones with the same
    weights, on rows per expert of ``EDGE_ROWS``: outputs and the gradients of the rows, the probabilities and every
    expert parameter."""
    from transformers import AutoConfig

    from actorcore.mcore.run.call_plan import _is_moe
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(ep=2)
    initialize_megatron(parallel)
    out = {}
    for model_type, directory in directories.items():
        config = AutoConfig.from_pretrained(directory)
        experts = {}
        for kernel in ("grouped", "sequential"):
            model = build_gpt_model(config, parallel, moe_experts=kernel)
            load_hf_into_mcore(model, directory)
            experts[kernel] = next(layer.mlp.experts for layer in model.chunks[0].decoder.layers if _is_moe(layer))
        for counts in EDGE_ROWS:
            gen = torch.Generator().manual_seed(sum(counts))
            rows = torch.randn(sum(counts), config.hidden_size, generator=gen)
            probs, grad = torch.rand(sum(counts), generator=gen), torch.randn(sum(counts), config.hidden_size,
                                                                             generator=gen)
            for kernel, module in experts.items():
                module.zero_grad(set_to_none=True)
                inputs = (rows.clone().requires_grad_(), probs.clone().requires_grad_())
                output, bias = module(inputs[0], torch.tensor(counts), inputs[1])
                output.backward(grad)
                params = {name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for name, p in module.named_parameters()}
                out[(model_type, tuple(counts), kernel)] = (output.detach(), bias, inputs[0].grad, inputs[1].grad,
                                                            params, type(module).__name__)
    return out

class SavedBytes:
    """Bytes per token that the given layers (MoE blocks, decoder layers) save for backward (distinct storages, the parameters' aside), in each
    of their forwards."""

    def __init__(self, layers: list, parameters: list) -> None:
        self.inside, self.forwards = None, []
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        for layer in layers:
            layer.register_forward_pre_hook(self._enter, with_kwargs=True)
            layer.register_forward_hook(lambda *_: setattr(self, "inside", None))

    def _enter(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.inside = {"tokens": hidden.shape[0], "storages": set(), "bytes": 0}
        self.forwards.append(self.inside)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if self.inside is not None and storage.data_ptr() not in self.inside["storages"] | self.parameters:
            self.inside["storages"].add(storage.data_ptr())
            self.inside["bytes"] += storage.nbytes()
        return t

    def most_per_token(self) -> float:
        return max((f["bytes"] / f["tokens"] for f in self.forwards), default=0.0)


def _quack_experts_case(directory: str, tp: int, ep: int, compiled_layers: bool) -> dict:
    """bf16: one training step with the quack experts (quack's GEMMs as the documented stand-in) and one with the
    grouped_mm experts, same weights; each ``(log-probs, gradients, trace, moe_experts, each MoE layer's
    local_experts)``. At TP=2 x EP=2 the dispatcher sorts the rows for both; with every expert on one rank (DP=2)
    the quack experts take the tokens directly."""
    from transformers import AutoConfig

    from actorcore.mcore.build.gather_dispatch import GatherMoELayer
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.build.recompute import moe_block_bytes_per_token
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.testing.quack_stand_in import use_quack_stand_in

    parallel = McoreParallel(tp=tp, ep=ep)
    initialize_megatron(parallel)
    config = AutoConfig.from_pretrained(directory)
    import actorcore.mcore.build.grouped_experts as grouped_experts

    undo = use_quack_stand_in()
    real_compiled, compiled_here = grouped_experts.compiled, set()

    def recorded(fn):  # which functions the experts compile (the local path's row passes)
        compiled_here.add(fn.__name__)
        return real_compiled(fn)

    grouped_experts.compiled = recorded
    try:
        out = {}
        for kernel in ("quack", "grouped"):
            compiled_here.clear()
            model = build_gpt_model(config, parallel, torch.bfloat16, moe_experts=kernel,
                                    compiled_layers=compiled_layers)
            load_hf_into_mcore(model, directory)
            moe = [m for chunk in model.chunks for m in chunk.modules() if isinstance(m, GatherMoELayer)]
            trace, saved = Counter(), SavedBytes(moe, [p for chunk in model.chunks for p in chunk.parameters()])
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                out[kernel] = (*_train_step(model, _batches(), trace), dict(trace), model.moe_experts,
                               [m.local_experts for m in moe])
            out[f"{kernel}_compiled"] = sorted(compiled_here)
            out[f"{kernel}_saved_per_token"] = saved.most_per_token()
        out["local_estimate_per_token"] = moe_block_bytes_per_token(model.config, 2, local_experts=True)
        return out
    finally:
        grouped_experts.compiled = real_compiled
        undo()


def _norm_input_case(directory: str, quack: bool) -> dict:
    """One TP rank, bf16, compiled layers: one training step per recompute mode with the projections keeping their
    norms' inputs (the default there), and one keeping the norms' outputs (the layers' switches off); each
    ``(log-probs, gradients, trace, saved bytes per layer forward and token, the layers' switches)``. ``quack``:
    quack's experts and dense MLP (the stand-in), every expert on each rank (the router and the local experts keep
    the pre-MLP norm's input); else the grouped_mm experts at EP=2 and the compiled activation."""
    from transformers import AutoConfig

    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.build.attention import use_attention_backend
    from actorcore.mcore.run.call_plan import decoder_layers
    from actorcore.testing.fa4_stand_in import use_fa4_stand_in
    from actorcore.testing.quack_stand_in import use_quack_stand_in

    parallel = McoreParallel() if quack else McoreParallel(ep=2)
    initialize_megatron(parallel)
    config = AutoConfig.from_pretrained(directory)
    kernels = dict(moe_experts="quack", swiglu_mlp="quack") if quack else dict(moe_experts="grouped", swiglu_mlp=False)
    undo = use_quack_stand_in() if quack else (lambda: None)
    _, undo_fa4 = use_fa4_stand_in()  # an attention kernel that keeps its q and k, as FA4 does
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out = {"hidden_size": config.hidden_size,
           "rotated_width": (config.num_attention_heads + config.num_key_value_heads) * head_dim}
    try:
        for name, options in (("kept", {}), ("full", dict(recompute="full")),
                              ("selective", dict(recompute="selective")), ("outputs_kept", {}), ("rotated_kept", {})):
            model = build_gpt_model(config, parallel, torch.bfloat16, compiled_layers=True, **kernels, **options)
            load_hf_into_mcore(model, directory)
            use_attention_backend(model, "fa4")
            layers = decoder_layers(model)
            switches = [(layer.recompute_qkv_input, layer.recompute_mlp_input) for layer in layers]
            if name == "outputs_kept":
                for layer in layers:
                    layer.recompute_qkv_input = layer.recompute_mlp_input = False
            if name == "rotated_kept":
                for layer in layers:
                    layer.recompute_rotated_qk = False
            trace, saved = Counter(), SavedBytes(layers, [p for chunk in model.chunks for p in chunk.parameters()])
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                out[name] = (*_train_step(model, _batches(), trace), dict(trace),
                             [f["bytes"] / f["tokens"] for f in saved.forwards], switches)
    finally:
        undo()
        undo_fa4()
    return out


def _quack_mlp_case(directory: str) -> dict:
    """EP=2 (one TP rank), bf16, compiled layers: one training step with the dense layer's MLP on quack's gated GEMMs
    (the stand-in) and one with the compiled activation between plain GEMMs, same weights."""
    from transformers import AutoConfig

    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.testing.quack_stand_in import use_quack_stand_in

    parallel = McoreParallel(ep=2)
    initialize_megatron(parallel)
    config = AutoConfig.from_pretrained(directory)
    undo = use_quack_stand_in()
    try:
        out = {}
        for choice in ("quack", False):
            model = build_gpt_model(config, parallel, torch.bfloat16, moe_experts="grouped", compiled_layers=True,
                                    swiglu_mlp=choice)
            load_hf_into_mcore(model, directory)
            trace = Counter()
            out[choice] = (*_train_step(model, _batches(), trace), dict(trace), model.swiglu_mlp)
        with pytest.raises(ValueError, match="runs inside the compiled layers"):
            build_gpt_model(config, parallel, torch.bfloat16, compiled_layers=False, swiglu_mlp="quack")
        return out
    finally:
        undo()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    from support.mcore_logprobs import tiny_hf

    root = str(tmp_path_factory.mktemp("mcore_speed"))
    cases = []
    for name, (model_type, tp, ep, overrides) in FAMILY_CASES.items():
        directory = os.path.join(root, name)
        tiny_hf(model_type, **overrides).save_pretrained(directory)
        cases.append((name, _family_case, (model_type, tp, ep, overrides, directory)))
    cases.append(("checkpoint_swap", _checkpoint_swap_case, (os.path.join(root, "qwen3_moe_ep2"), root)))
    cases.append(("recompute", _recompute_case, (os.path.join(root, "qwen3_moe_ep2"),)))
    cases.append(("quack_stand_in", _quack_experts_case, (os.path.join(root, "qwen3_moe_ep2"), 2, 2, "auto")))
    cases.append(("quack_mlp", _quack_mlp_case, (os.path.join(root, "qwen3_moe_ep2"),)))
    cases.append(("norm_input", _norm_input_case, (os.path.join(root, "qwen3_moe_ep2"), False)))
    cases.append(("norm_input_quack", _norm_input_case, (os.path.join(root, "qwen3_moe_ep2"), True)))
    cases.append(("local_experts", _quack_experts_case, (os.path.join(root, "qwen3_moe_ep2"), 1, 1, True)))
    cases.append(("edge_rows", _edge_rows_case, ({m: os.path.join(root, f"{m}_ep2") for m in ("qwen3_moe", "gpt_oss")},)))
    return spawn_cases(2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_grouped_experts_match_transformers_per_token_and_gradient(world2, name):
    from support.mcore_moe_tp import assert_matches_transformers

    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    for rank, result in enumerate(world2[name]):
        where = f"{name} rank {rank}"
        assert result["experts"] == "grouped", where
        assert result["in_place"] and all(result["in_place"]), where  # the weights read in place, under Megatron's DDP
        assert result["trace"]["moe_experts:grouped_calls"] >= 2 * len(_sequences()), where
        assert_matches_transformers(result, tol, grad_tol, where)


@pytest.mark.slow
def test_checkpoint_saved_with_grouped_experts_loads_into_sequential_and_back(world2, tmp_path):
    from safetensors.torch import load_file

    from support.mcore_logprobs import tiny_hf

    hf = tiny_hf("qwen3_moe")
    hf.save_pretrained(tmp_path)
    original = load_file(os.path.join(tmp_path, "model.safetensors"))
    tol = TOL["grouped_experts_vs_sequential_fp32_rel"]
    for rank, result in enumerate(world2["checkpoint_swap"]):
        assert result["types"] == {"grouped": "GroupedExperts", "sequential": "SequentialMLP"}
        assert result["keys"]["grouped"] == result["keys"]["sequential"], rank
        for kernel, exported in result["exported"].items():
            assert sorted(exported) == sorted(original), (rank, kernel)
            for name, tensor in original.items():
                assert torch.equal(exported[name], tensor), (rank, kernel, name)
        (grouped_lp, grouped_grads), (sequential_lp, sequential_grads) = (result["steps"]["grouped"],
                                                                          result["steps"]["sequential"])
        for a, b in zip(grouped_lp, sequential_lp):
            torch.testing.assert_close(a, b, atol=tol, rtol=0)
        assert sorted(grouped_grads) == sorted(sequential_grads)
        for name, grad in grouped_grads.items():
            want = sequential_grads[name]
            torch.testing.assert_close(grad, want, atol=tol * want.abs().max(), rtol=0, msg=f"rank {rank} {name}")


@pytest.mark.slow
def test_recompute_modes_give_bitwise_the_gradients_of_none(world2):
    fp32_tol, grad_tol = TOL["compiled_decoder_vs_eager_fp32"], TOL["grad_compiled_decoder_vs_eager_fp32_rel"]
    for rank, result in enumerate(world2["recompute"]):
        none_lp, none_grads, none_trace, _ = result["none"]
        assert none_trace["mcore:recompute_kept_layers"] == 2 * len(_sequences()) and not none_trace.get(
            "mcore:compiled_layers")
        for name in ("full", "selective", "auto"):
            lp, grads, trace, fused = result[name]
            assert not fused
            for a, b in zip(lp, none_lp):
                assert torch.equal(a, b), (rank, name)
            assert sorted(grads) == sorted(none_grads)
            for param, grad in grads.items():
                assert torch.equal(grad, none_grads[param]), (rank, name, param)
        assert result["full"][2]["mcore:recompute_full_layers"] == 2 * len(_sequences())
        assert result["selective"][2]["checkpoint:selective"] == 2 * len(_sequences())
        auto = result["auto"][2]
        assert auto["mcore:recompute_selective_layers"] == auto["mcore:recompute_kept_layers"] == len(_sequences())
        fused_lp, fused_grads, fused_trace, fused = result["fused"]
        assert fused and fused_trace["mcore:compiled_layers"] == 2 * len(_sequences())
        assert fused_trace["mcore:fused_rope"] == 2 * len(_sequences()), "the compiled layers' RoPE did not run"
        assert fused_trace["mcore:fused_qk_norm"] == 2 * len(_sequences()), "the fused q/k norms did not run"
        assert not none_trace.get("mcore:fused_rope") and not none_trace.get("mcore:fused_qk_norm")
        for trace in (none_trace, fused_trace):  # one MoE layer: the gather-only dispatch once per micro-batch
            assert trace["mcore:gather_dispatch"] == len(_sequences()), "the gather-only dispatch did not run"
        for a, b in zip(fused_lp, none_lp):
            torch.testing.assert_close(a, b, atol=fp32_tol, rtol=0)
        for param, grad in fused_grads.items():
            torch.testing.assert_close(grad, none_grads[param], atol=grad_tol * none_grads[param].abs().max(), rtol=0,
                                       msg=f"rank {rank} {param}")
        selective_lp, selective_grads, selective_trace, _ = result["fused_selective"]
        assert selective_trace["checkpoint:selective"] == 2 * len(_sequences())
        assert selective_trace["mcore:compiled_layers"] >= 2 * 2 * len(_sequences())  # forward and recompute
        for a, b in zip(selective_lp, fused_lp):
            assert torch.equal(a, b), rank
        for param, grad in selective_grads.items():
            assert torch.equal(grad, fused_grads[param]), (rank, param)


@pytest.mark.slow
def test_grouped_experts_take_empty_and_single_row_experts(world2):
    """Against megatron-core's sequential experts with the same weights: outputs and every gradient (rows,
    probabilities, expert parameters) to fp32 summation order (torch's CPU grouped GEMM and MKL's per-expert GEMM
    may add in other orders; a bias's rows are summed by a one-hot GEMM); an expert without rows gets zero
    gradients."""
    tol = TOL["grouped_experts_vs_sequential_fp32_rel"]

    def close(got, want, where):
        assert got.shape == want.shape, where
        if want.numel():
            torch.testing.assert_close(got, want, atol=tol * want.abs().max(), rtol=0, msg=str(where))

    for rank, result in enumerate(world2["edge_rows"]):
        for model_type in ("qwen3_moe", "gpt_oss"):
            for counts in EDGE_ROWS:
                got, want = result[(model_type, tuple(counts), "grouped")], result[(model_type, tuple(counts),
                                                                                    "sequential")]
                where = (rank, model_type, counts)
                assert (got[5], want[5]) == ("GroupedExperts", "SequentialMLP"), where
                assert got[1] is None and want[1] is None, where
                for index in (0, 2, 3):  # output, rows' and probabilities' gradients
                    close(got[index], want[index], (*where, index))
                assert sorted(got[4]) == sorted(want[4]), where
                for name, grad in want[4].items():
                    close(got[4][name], grad, (*where, name))
                    expert = int(name.split(".")[1])
                    assert bool(grad.any()) == (counts[expert] > 0), (where, name)


def _assert_within_bf16_rounding(quack_lp, quack_grads, lp, grads, rank) -> None:
    """Log-probs per token and every gradient (relative L2 norm) of a quack run within bf16 rounding of the other."""
    for a, b in zip(quack_lp, lp):
        torch.testing.assert_close(a, b, atol=TOL["quack_experts_vs_grouped_bf16"], rtol=0)
    assert sorted(quack_grads) == sorted(grads), rank
    for name, grad in grads.items():
        diff = (quack_grads[name].float() - grad.float()).norm()
        assert diff <= TOL["grad_quack_experts_vs_grouped_bf16_rel_norm"] * grad.float().norm(), (rank, name)


@pytest.mark.slow
def test_quack_experts_within_bf16_rounding_of_grouped_mm(world2):
    """The quack kernel's plumbing on the CPU (weights per expert, offsets, the probabilities' gradient from the
    dgated epilogue, rows sorted by Megatron's dispatcher at TP=2 x EP=2), quack's GEMMs as the stand-in: per token
    and per gradient within bf16 rounding of the grouped_mm experts."""
    for rank, result in enumerate(world2["quack_stand_in"]):
        (quack_lp, quack_grads, trace, kernel, _), (lp, grads, _, _, _) = result["quack"], result["grouped"]
        assert kernel == "quack" and trace["moe_experts:quack_calls"] == len(_sequences()), rank
        _assert_within_bf16_rounding(quack_lp, quack_grads, lp, grads, rank)


@pytest.mark.slow
def test_local_quack_experts_skip_the_dispatcher_within_bf16_rounding(world2):
    """Every expert on one rank: the quack experts take the tokens directly (the gather in the GEMM's loads, each
    expert's output weighted and summed in fp32, the routing probabilities' gradient from the dgated epilogue),
    per token and per gradient within bf16 rounding of the grouped_mm experts behind Megatron's dispatcher; the
    trace proves the dispatcher did not run for them and did for the grouped ones."""
    for rank, result in enumerate(world2["local_experts"]):
        (quack_lp, quack_grads, trace, _, local), (lp, grads, grouped_trace, _, grouped_local) = \
            result["quack"], result["grouped"]
        moe_layers = len(local)
        assert moe_layers and all(local) and not any(grouped_local), rank
        assert trace["mcore:local_experts"] == moe_layers * len(_sequences()), (rank, trace)
        assert not trace.get("mcore:gather_dispatch") and trace["moe_experts:quack_calls"] == trace[
            "mcore:local_experts"], (rank, trace)
        assert grouped_trace["mcore:gather_dispatch"] == moe_layers * len(_sequences()), (rank, grouped_trace)
        assert not grouped_trace.get("mcore:local_experts"), rank
        # with the compiled layers the combine and the per-token gradient sum run compiled (one kernel each)
        assert {"weighted_rows_per_token", "sum_rows_per_token"} <= set(result["quack_compiled"]), rank
        _assert_within_bf16_rounding(quack_lp, quack_grads, lp, grads, rank)
        # the recompute planner's first guess for such a layer errs on the large side, not by the dispatcher's rows
        saved, estimate = result["quack_saved_per_token"], result["local_estimate_per_token"]
        assert 0 < saved <= estimate <= 2 * saved, (rank, saved, estimate)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["norm_input", "norm_input_quack"])
def test_projections_keep_the_norms_inputs_bitwise_across_recompute_modes(world2, case):
    """At one TP rank the compiled layers' QKV projection and MLP keep their norms' inputs and recompute the norms in
    backward (``mcore/build/normed_projection.py``): a dense fc1, quack's dense MLP, and with every expert on the rank
    the MoE layer's router and quack's local experts. One hidden-sized tensor per token less for each (measured on the
    saved tensors), per token and per gradient within bf16 rounding of keeping the norms' outputs, and bitwise the same
    under the full and the selective checkpoint (where the layer runs again, or under PyTorch's selective-checkpoint
    policy). Without local experts (EP=2) the MoE layer keeps its input, as Megatron's does. The same for the core
    attention's rotated q and k (``mcore/build/rotated_qk.py``), made again in backward from the QKV projection."""
    quack = case == "norm_input_quack"
    for rank, result in enumerate(world2[case]):
        kept_lp, kept_grads, trace, kept_saved, switches = result["kept"]
        assert switches == [(True, quack), (True, True)], rank  # layer 0 is MoE, layer 1 dense
        per_batch = 4 if quack else 3  # QKV twice, the dense MLP, the MoE layer (local experts only)
        calls = per_batch * len(_sequences())
        assert trace["mcore:recomputed_norm_input"] == calls, (rank, trace)
        for mode in ("full", "selective"):
            lp, grads, mode_trace, _, _ = result[mode]
            # the forward's, and the recompute's until torch's checkpoint has what backward needs
            assert calls < mode_trace["mcore:recomputed_norm_input"] <= 2 * calls, (rank, mode)
            assert all(torch.equal(a, b) for a, b in zip(lp, kept_lp)), (rank, mode)
            assert all(torch.equal(grads[n], g) for n, g in kept_grads.items()), (rank, mode)
        lp, grads, off_trace, off_saved, _ = result["outputs_kept"]
        assert not off_trace.get("mcore:recomputed_norm_input"), rank
        _assert_within_bf16_rounding(kept_lp, kept_grads, lp, grads, rank)
        hidden_bytes = 2 * result["hidden_size"]  # bf16
        for forward, (kept, off) in enumerate(zip(kept_saved, off_saved)):
            moe = forward % 2 == 0
            assert (off - kept) / hidden_bytes == pytest.approx(2 if quack or not moe else 1), (rank, forward, off)
        # the attention kernel's rotated q and k (FA4's stand-in keeps them) made again from the projection: bitwise
        # the same step, their bytes less in every layer forward; not under a checkpoint (it recomputes anyway)
        assert trace["mcore:recomputed_rotated_qk"] == 2 * len(_sequences()), (rank, trace)
        assert not any(result[mode][2].get("mcore:recomputed_rotated_qk") for mode in ("full", "selective")), rank
        lp, grads, rotated_trace, rotated_saved, _ = result["rotated_kept"]
        assert not rotated_trace.get("mcore:recomputed_rotated_qk"), rank
        assert all(torch.equal(a, b) for a, b in zip(lp, kept_lp)), rank
        assert all(torch.equal(grads[n], g) for n, g in kept_grads.items()), rank
        rotated_bytes = 2 * result["rotated_width"]  # q's and k's heads, bf16
        for forward, (kept, rotated) in enumerate(zip(kept_saved, rotated_saved)):
            assert (rotated - kept) / rotated_bytes == pytest.approx(1), (rank, forward, kept, rotated)


@pytest.mark.slow
def test_quack_dense_mlp_within_bf16_rounding_of_the_compiled_activation(world2):
    """The dense MLP of the compiled layers as quack's gated GEMMs (the stand-in on the CPU: the weight views, the
    interleaving, the gradients back into fc1's ``[gate; up]`` rows), per token and per gradient within bf16 rounding
    of the compiled activation between plain GEMMs; a quack MLP without the compiled layers is refused."""
    for rank, result in enumerate(world2["quack_mlp"]):
        (quack_lp, quack_grads, trace, choice), (lp, grads, plain_trace, plain) = result["quack"], result[False]
        assert choice == "quack" and plain is False, rank
        dense_layers = 1
        assert trace["mcore:quack_mlp"] == dense_layers * len(_sequences()) and not plain_trace.get("mcore:quack_mlp")
        _assert_within_bf16_rounding(quack_lp, quack_grads, lp, grads, rank)
