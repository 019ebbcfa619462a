"""verl 0.9.x's FSDP engine (``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead``, the engine its
actor runs) built by verl itself on actorcore's ``apply_monkey_patch``, on tiny models on the CPU.

verl's engine builds the model (``from_pretrained`` of a saved tiny Qwen2, sdpa), patches it with the
``apply_monkey_patch`` named in its module (replaced by actorcore's: the switch a verl 0.9 user makes), wraps it
in FSDP2 on verl's device mesh (fp32 mixed precision, gradient checkpointing on: verl's defaults otherwise), and
runs its own ``infer_batch`` (``compute_log_prob``: ``prepare_model_inputs`` -> model -> ``prepare_model_outputs``,
Ulysses pad/slice and gather included) and ``forward_backward_batch`` with verl's ``ppo_loss``:
- log-probs and entropy per token (every position that predicts a token of its own sequence) equal the plain
  transformers model run one sequence at a time, fused kernels on and off, on 1 rank and with Ulysses SP=2 on
  2 gloo ranks (verl's own Ulysses mesh);
- the parameter gradients of one PPO loss equal those of the same engine on verl's own ``apply_monkey_patch``
  without fused kernels and without SP (verl's own patch needs flash-attn for Ulysses; its fused torch forward,
  ``dense_common.forward_with_torch_backend``, fails under FSDP2 on the CPU with "aten.mm.default got mixed
  torch.Tensor and DTensor": it multiplies by ``self.lm_head.weight``, a DTensor, outside FSDP2's unshard).

verl 0.9 has no CPU platform (it falls back to "nvidia" and calls ``torch.cuda.set_device``): the test registers
one through verl's platform plugin API (``verl.plugin.platform.platform_manager.set_platform``) when the module
is imported, before verl's engine module reads its device. verl's padding
helpers dispatch to flash_attn; they are pointed at verl's own pure-torch copy, as in test_dp_actor.py.
Skipped where ``verl.workers.engine.fsdp.transformer_impl`` cannot be imported; install: tests/verl/README.md.
"""

import contextlib
import functools

import pytest
from verl_required import import_verl_or_skip
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL
from rollout_layout import padded_rollout

PROMPTS = (3, 5, 1, 4)  # prompt lengths, left-padded to 5
RESPONSES = (6, 2, 4, 5)  # response lengths, right-padded to 6
TEMPERATURE = 0.7


def _use_the_cpu_as_verls_platform():
    """verl 0.9 has no CPU platform: register one through its plugin API before verl reads the device (its
    engine module keeps ``device_name`` from import time)."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """The CPU as a verl platform (verl 0.9 ships CUDA, NPU and ROCm only)."""

        device_name, vendor_name, device_module = "cpu", "cpu", torch.cpu

        def is_available(self): return True
        def current_device(self): return "cpu"  # verl passes it to .to()
        def device_count(self): return 1
        def set_device(self, index): pass
        def synchronize(self, index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, index=0): return None, None
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CPU_VISIBLE_DEVICES"
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

    platform_manager.set_platform(PlatformCPU())


import_verl_or_skip("verl.plugin.platform.platform_manager", "0.9", reason="verl (0.9.x) not installed")
if not torch.cuda.is_available():
    _use_the_cpu_as_verls_platform()
import_verl_or_skip("verl.workers.engine.fsdp.transformer_impl", "0.9",
                    reason="verl (0.9.x, with the modules it imports) not installed")


def _use_verls_torch_padding_helpers():
    """verl dispatches unpad_input / pad_input to flash_attn (CUDA) or to its own pure-torch copy (NPU); there is
    no flash_attn on the CPU, so point the dispatcher at verl's pure-torch copy (the same functions)."""
    from verl.utils import attention_utils, npu_flash_attn_utils as torch_copy

    helpers = (torch_copy.index_first_axis, torch_copy.pad_input, torch_copy.rearrange, torch_copy.unpad_input)
    attention_utils._get_attention_functions = lambda: helpers


def _hide_trl_from_verls_patch():
    """verl 0.9.1's own apply_monkey_patch imports ``AutoModelForCausalLMWithValueHead`` from trl whenever trl is
    importable; trl 1.16 (installed for the TRL tests) no longer has it, so verl's patch fails with an ImportError.
    The value-head wrapper is not used here: tell verl's patch that trl is absent."""
    from verl.models.transformers import monkey_patch

    monkey_patch.is_trl_available = lambda: False


def _padded_batch():
    return padded_rollout(PROMPTS, RESPONSES, seed=17, ppo=True)


def _engine_data(fused, remove_padding=True):
    """The engine's no-padding TensorDict, made by verl's own converter."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(TensorDict(_padded_batch(), batch_size=[len(PROMPTS)]))
    tu.assign_non_tensor(data, temperature=TEMPERATURE, calculate_entropy=True,
                         use_remove_padding=remove_padding, use_fused_kernels=fused, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         global_batch_size=len(PROMPTS))
    return data


def _reference():
    """Plain transformers, one sequence at a time: per sequence, log p(token t+1) and the entropy at t."""
    from actorcore.testing.tiny_configs import build_tiny_model

    model, batch, P = build_tiny_model("qwen2", seed=3), _padded_batch(), max(PROMPTS)
    out = []
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            seq = batch["input_ids"][i, P - p:P + r]
            logp = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1] / TEMPERATURE, -1)
            out.append((logp.gather(-1, seq[1:, None])[:, 0], -(logp.exp() * logp).sum(-1)))
    return out


def _engine(path, patch, fused, sp, remove_padding=True):
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.apply_monkey_patch = patch
    model_config = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=remove_padding,
                                 use_fused_kernels=fused,
                                 fused_kernel_options={"impl_backend": "torch"} if fused else {},
                                 override_config={"attn_implementation": "sdpa"})
    engine_config = FSDPEngineConfig(strategy="fsdp2", ulysses_sequence_parallel_size=sp, use_torch_compile=False,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"})
    engine = transformer_impl.FSDPEngineWithLMHead(model_config=model_config, engine_config=engine_config,
                                                   optimizer_config=FSDPOptimizerConfig(lr=0.1),
                                                   checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def _ppo_gradients(engine, fused, remove_padding=True):
    """One forward_backward_batch of verl's ppo_loss (clip, entropy bonus, low-var KL); full gradients by name."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01,
                             use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", clip_ratio=0.2)
    engine.optimizer_zero_grad()
    with engine.train_mode():  # which zeroes the gradients on exit
        engine.forward_backward_batch(_engine_data(fused, remove_padding), functools.partial(ppo_loss, config), forward_only=False)
        return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in engine.module.named_parameters()}


def _worker(rank, world_size, path):
    from actorcore.compat.verl import VerlForward, VerlUlyssesGroup, apply_monkey_patch

    _use_verls_torch_padding_helpers()
    from verl.workers.engine.fsdp import transformer_impl

    verls_patch = transformer_impl.apply_monkey_patch
    _hide_trl_from_verls_patch()
    want = _reference()
    # verl's own patch, logits path, no SP (on 2 ranks: dp=2 on the same data, the same gradients). Its fused
    # torch forward is not the reference: under FSDP2 here it fails (module docstring).
    ref_grads = _ppo_gradients(_engine(path, verls_patch, False, 1), False)
    result = {}
    # (fused, remove_padding): verl's padded path (use_remove_padding=False) exists without Ulysses only
    for fused, remove_padding in ((False, True), (True, True)) + (((True, False),) if world_size == 1 else ()):
        engine = _engine(path, apply_monkey_patch, fused, world_size, remove_padding)
        forward = engine.module.__dict__.get("forward")
        assert isinstance(forward, VerlForward), "actorcore's forward is not installed"
        assert isinstance(forward.parallel, VerlUlyssesGroup) == (world_size > 1), "not on verl's Ulysses group"
        with engine.eval_mode():
            out = engine.infer_batch(_engine_data(fused, remove_padding))["model_output"]
        worst = 0.0
        for (lp, ent), (want_lp, want_ent) in zip(zip(out["log_probs"].unbind(), out["entropy"].unbind()), want):
            n = want_lp.numel()  # the last position predicts the next sequence's first token: verl never reads it
            worst = max(worst, (lp[:n] - want_lp).abs().max().item(), (ent[:n] - want_ent).abs().max().item())
        grads = _ppo_gradients(engine, fused, remove_padding)
        result[(fused, remove_padding)] = {"forward": worst, "grad_rel": max((grads[n] - g).abs().max().item() / g.abs().max().item()
                                                           for n, g in ref_grads.items())}
    return result


@pytest.mark.parametrize("world_size", [1, 2])
def test_verl_fsdp_engine_on_actorcore_patch_matches_plain_transformers_and_verls_patch(world_size, tmp_path,
                                                                                      monkeypatch):
    from actorcore.testing.tiny_configs import build_tiny_model

    # transformers >= 5.25 kernelizes every from_pretrained model with Hub kernels unless told not to, and refuses
    # verl's meta-device init ("Unsupported device type 'meta'"); nothing may come from the Hub here anyway.
    monkeypatch.setenv("USE_HUB_KERNELS", "0")
    build_tiny_model("qwen2", seed=3).save_pretrained(tmp_path)
    for rank, res in enumerate(run_distributed(_worker, world_size, (str(tmp_path),))):
        print(world_size, rank, res)
        assert len(res) == (3 if world_size == 1 else 2)
        for (fused, remove_padding), r in res.items():
            where = f"rank {rank} sp={world_size} fused={fused} remove_padding={remove_padding}"
            assert r["forward"] <= TOL["packed_vs_hf_fp32"], f"{where}: log-prob/entropy |Δ| {r['forward']:.2e}"
            assert r["grad_rel"] <= TOL["grad_packed_vs_hf_fp32_rel"], f"{where}: gradient rel |Δ| {r['grad_rel']:.2e}"
