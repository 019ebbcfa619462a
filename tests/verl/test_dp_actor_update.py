"""verl 0.7.1's own ``DataParallelPPOActor.update_policy`` and ``compute_log_prob`` on actorcore's patch.

One real PPO update (two mini-batches of two sequences, gradient accumulation over micro-batches of one,
clipped ratios against off-policy old log-probs, entropy bonus, low-var KL to a reference, verl's grad-norm
clip, SGD step) runs through verl's code twice from the same weights: on a model patched with
``actorcore.compat.verl.apply_monkey_patch`` (remove-padding, fused kernels on and off), and on the plain
transformers model with ``use_remove_padding=False`` (verl's padded path: the model's own forward, no patch).
Every parameter's gradient at each optimizer step, its updated value and verl's returned metrics must agree;
``compute_log_prob`` (fixed and dynamic micro-batches) must equal the unpatched model run one sequence at a time,
per response token.

Layouts: one process; FSDP2 (verl's own ``apply_fsdp2`` with its actor's mixed-precision policy, in fp32, and
``fsdp2_clip_grad_norm_``) on 2 gloo ranks with different data per rank (DP=2); Ulysses SP=2 under FSDP2 on 2
ranks with verl's own Ulysses group (the reference: the same FSDP2 model without SP or patch). FSDP1 (verl
0.7.1's default strategy "fsdp") cannot run on the CPU: torch 2.13 refuses it ("RuntimeError: FSDP needs a non-CPU
accelerator device, but no accelerator device is detected"), so FSDP1 can only be checked on a GPU machine.

Installs nothing: skipped where ``verl.workers.actor.dp_actor`` cannot be imported. The install used (a
``--target`` directory, no network except PyPI) is in tests/verl/README.md.
"""

import pytest
from verl_required import import_verl_or_skip
import torch

import_verl_or_skip("verl.workers.actor.dp_actor", "0.7",
                    reason="verl (0.7.x, with the modules it imports) not installed")

from actorcore.testing.distributed import run_distributed  # noqa: E402
from actorcore.testing.tolerances import TOL  # noqa: E402
from rollout_layout import padded_rollout  # noqa: E402

PROMPTS = (3, 5, 1, 4)  # prompt lengths, left-padded to 5
RESPONSES = (6, 2, 4, 5)  # response lengths, right-padded to 6
TEMPERATURE = 0.7
LR = 0.5


def _batch(seed):
    return padded_rollout(PROMPTS, RESPONSES, seed, ppo=True)


def _reference_logprobs(model, batch):
    """Per sequence, plain HF forward: log p(response token) at temperature, as ``[B, R]`` (0 past the end)."""
    P = max(PROMPTS)
    out = torch.zeros(batch["responses"].shape)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            seq = batch["input_ids"][i, P - p:P + r]
            logp = torch.log_softmax(model(input_ids=seq[None]).logits[0] / TEMPERATURE, -1)[p - 1:p + r - 1]
            out[i, :r] = logp.gather(-1, seq[p:, None])[:, 0]
    return out


def _use_verls_torch_padding_helpers():
    """verl dispatches unpad_input / pad_input to flash_attn (CUDA) or to its own pure-torch copy (NPU); there is
    no flash_attn on the CPU, so point the dispatcher at verl's pure-torch copy (the same functions)."""
    from verl.utils import attention_utils, npu_flash_attn_utils as torch_copy

    helpers = (torch_copy.index_first_axis, torch_copy.pad_input, torch_copy.rearrange, torch_copy.unpad_input)
    attention_utils._get_attention_functions = lambda: helpers


def _config(remove_padding, fused, sp):
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

    return FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1,
        use_remove_padding=remove_padding, use_fused_kernels=fused, ulysses_sequence_parallel_size=sp,
        use_torch_compile=False, entropy_coeff=0.01, calculate_entropy=True, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl", clip_ratio=0.2, grad_clip=1.0, fsdp_config=FSDPEngineConfig(dtype="float32"))


def _count_calls(model, calls):
    """Proof that verl called actorcore's forward (transformers alone also packs by position ids on sdpa)."""
    from actorcore.compat.verl import VerlForward

    forward = model.__dict__["forward"]
    assert isinstance(forward, VerlForward)

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.__dict__["forward"] = counted


def _shard(model, world_size):
    """FSDP2 by verl's own ``apply_fsdp2``, with the kwargs verl 0.7.1's fsdp_workers passes for the actor
    (mixed-precision policy in fp32 here, which still casts every forward's inputs; verl's shard placement)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from verl.utils.fsdp_utils import apply_fsdp2, get_shard_placement_fn
    from verl.workers.config import FSDPEngineConfig

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    fsdp_kwargs = {"mesh": mesh, "offload_policy": None, "reshard_after_forward": True,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                     cast_forward_inputs=True),
                   "shard_placement_fn": get_shard_placement_fn(fsdp_size=world_size)}
    # verl 0.7.1 indexes the model's _no_split_modules, a set in transformers 5: name the layer class instead
    wrap = {"transformer_layer_cls_to_wrap": [type(model.model.layers[0]).__name__]}
    apply_fsdp2(model, fsdp_kwargs, FSDPEngineConfig(dtype="float32", wrap_policy=wrap))
    return model


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a full copy of every gradient it steps with (verl clears them after the update)."""

    def __init__(self, named_params, lr):
        named_params = list(named_params)
        super().__init__([p for _, p in named_params], lr=lr)
        self.names = {id(p): n for n, p in named_params}
        self.steps = []

    def step(self, closure=None):
        self.steps.append({self.names[id(p)]: _full(p.grad).clone() for g in self.param_groups for p in g["params"]})
        return super().step(closure)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _full_params(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _update(patched, fused, sp, fsdp, world_size, batch):
    """(gradients per optimizer step, updated parameters, verl's metrics, compute_log_prob outputs) of one
    update_policy through verl's actor."""
    from verl import DataProto
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    from actorcore.compat.verl import apply_monkey_patch
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen2", seed=3, attn_implementation="sdpa")
    calls = []
    if patched:
        apply_monkey_patch(model, sp, True, fused)  # verl's positional order
        _count_calls(model, calls)
    if fsdp:
        model = _shard(model, world_size)
    optimizer = RecordingSGD(model.named_parameters(), lr=LR)
    actor = DataParallelPPOActor(_config(patched, fused, sp), model, optimizer)
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": TEMPERATURE, "micro_batch_size": 2,
                                                          "use_dynamic_bsz": False})
    logprobs = {}
    for dynamic in (False, True):
        data.meta_info.update(use_dynamic_bsz=dynamic, max_token_len=12)
        out = actor.compute_log_prob(data, calculate_entropy=True)
        logprobs[dynamic] = out["log_probs"].detach()
    metrics = actor.update_policy(data)
    assert not patched or len(calls) >= 4, f"actorcore's patched forward ran {len(calls)} times"
    return optimizer.steps, _full_params(model), metrics, logprobs


def _worker(rank, world_size, mode):
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from actorcore.testing.tiny_configs import build_tiny_model

    _use_verls_torch_padding_helpers()
    sp = world_size if mode == "sp" else 1
    if sp > 1:
        set_ulysses_sequence_parallel_group(dist.new_group(list(range(world_size))))
    batch = _batch(17 + (rank if mode == "dp" else 0))
    initial = _full_params(build_tiny_model("qwen2", seed=3))
    want_lp = _reference_logprobs(build_tiny_model("qwen2", seed=3), batch)
    fsdp = mode != "single"
    ref_grads, ref_params, ref_metrics, _ = _update(False, False, 1, fsdp, world_size, batch)
    result = {}
    for fused in (True, False):
        grads, params, metrics, logprobs = _update(True, fused, sp, fsdp, world_size, batch)
        assert len(grads) == len(ref_grads) == 2, "two mini-batches, one optimizer step each"
        worst_grad = max((g[n] - ref[n]).abs().max().item() / ref[n].abs().max().item()
                         for g, ref in zip(grads, ref_grads) for n in ref)
        worst_param = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
        worst_lp = max((lp - want_lp).mul(batch["response_mask"]).abs().max().item() for lp in logprobs.values())
        # verl's metrics are means of per-token values (or the grad norm): |Δ| relative to max(1, |value|)
        keys = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl")
        worst_metric = max(abs(a - b) / max(abs(b), 1.0) for key in keys
                           for a, b in zip(_as_list(metrics[key]), _as_list(ref_metrics[key])))
        result[fused] = {"grad_rel": worst_grad, "param": worst_param, "logprob": worst_lp, "metric_rel": worst_metric,
                         "moved": max((ref_params[n] - initial[n]).abs().max().item() for n in initial)}
    return result


def _as_list(value):
    return value if isinstance(value, list) else [value]


@pytest.mark.parametrize("mode,world_size", [("single", 1), ("dp", 2), ("sp", 2)])
def test_verl_update_policy_and_compute_log_prob_match_plain_transformers(mode, world_size):
    for rank, res in enumerate(run_distributed(_worker, world_size, (mode,))):
        print(mode, rank, res)
        for fused, r in res.items():
            where = f"rank {rank} {mode} fused={fused}"
            assert r["moved"] > 1e-3, f"{where}: the update did not move the weights ({r['moved']:.1e})"
            assert r["logprob"] <= TOL["packed_vs_hf_fp32"], f"{where}: compute_log_prob |Δ| {r['logprob']:.2e}"
            assert r["grad_rel"] <= TOL["grad_packed_vs_hf_fp32_rel"], f"{where}: gradient rel |Δ| {r['grad_rel']:.2e}"
            assert r["param"] <= TOL["packed_vs_hf_fp32"], f"{where}: updated weights |Δ| {r['param']:.2e}"
            assert r["metric_rel"] <= TOL["packed_vs_hf_fp32"], f"{where}: metrics rel |Δ| {r['metric_rel']:.2e}"
