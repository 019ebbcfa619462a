"""TRL's own GRPOTrainer with vLLM in colocate mode (``GRPOConfig(use_vllm=True, vllm_mode="colocate")``) on vLLM's
CPU build, with and without ``patch_trainer``'s engine sync.

TRL builds its engine itself (``LLM(model=model.name_or_path, distributed_executor_backend="external_launcher",
...)``) in this process, and the engine reads the tokenizer saved beside the weights. TRL passes vLLM no ``dtype``,
and vLLM's ``"auto"`` runs a float32 checkpoint in the platform's 16-bit type (bfloat16 here): the float32 tests
add ``dtype="float32"`` to TRL's own ``LLM(...)`` call; the test of TRL's engine as TRL builds it keeps bfloat16.
Every engine here gets the suite's small KV cache (``kv_cache_memory_bytes``, added to the same call: on the CPU,
TRL's ``vllm_gpu_memory_utilization`` reserves that share of the machine's memory, and a CPU user sets
``VLLM_CPU_KVCACHE_SPACE`` in GiB instead). The environment variables TRL sets for vLLM (``RANK``, ``MASTER_PORT``,
...) are restored after each test.

- Without the engine sync, TRL's own ``sync_weights`` (``model.load_weights`` per parameter) fails half-way on the
  CPU build, inside ``trainer.train()``, and leaves a tied-head model's engine off the trainer's weights.
- With it, ``trainer.train()`` runs three steps; every step's sync goes through the bridge (verified, the tied head
  or the MoE experts processed again), and the engine's log-probs of the completions TRL then samples equal
  actorcore's on the policy, per token (float32).
- TRL's engine as TRL builds it (bfloat16) trains on the engine sync, each sync verified within the bridge's
  16-bit tolerance.
"""

from __future__ import annotations

import contextlib
import functools
import re

import pytest
import torch

pytest.importorskip("trl", reason="trl not installed (pip install trl==1.16.0)")

from actorcore.compat.trl import ENGINE_SYNC_METHOD, patch_trainer  # noqa: E402
from actorcore.testing.engines import ENGINE_FAMILIES, KV_CACHE_BYTES, training_step  # noqa: E402
from actorcore.testing.tiny_configs import build_tiny_model  # noqa: E402
from actorcore.testing.tolerances import TOL  # noqa: E402
from actorcore.testing.trl_cases import TEMPERATURE, build_trainer, make_eos_likely, tokenizer  # noqa: E402

FAR = 1e-3  # a control is "wrong" when it is this far from the trainer; agreement is TOL's 1e-5
TRL_ENGINE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what TRL sets for vLLM


def _policy(model_type: str, directory, **config):
    """The tiny policy of an engine family (head dim 32), eos likely, saved with its tokenizer where TRL's engine
    loads it (``model.name_or_path``)."""
    overrides, _ = ENGINE_FAMILIES[model_type]
    model = build_tiny_model(model_type, seed=4, attn_implementation="sdpa", **overrides, **config)
    model.config.eos_token_id, model.config.pad_token_id = 1, 0
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    make_eos_likely(model)
    model.save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    model.name_or_path = model.config._name_or_path = str(directory)
    return model


def _trl_vllm_trainer(model_type, tmp_path, monkeypatch, keep_engine, max_steps=3, float32=True, config=None,
                      **args):
    """TRL's GRPOTrainer with its colocated engine, built by TRL; its ``LLM(...)`` call gets the suite's KV cache
    size and, with ``float32``, ``dtype="float32"`` (module docstring)."""
    import trl.generation.vllm_generation as trl_vllm

    engine_options = dict(kv_cache_memory_bytes=KV_CACHE_BYTES, **({"dtype": "float32"} if float32 else {}))
    monkeypatch.setattr(trl_vllm, "LLM", functools.partial(trl_vllm.LLM, **engine_options))
    for name in TRL_ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)  # TRL sets them: restored after the test
    model = _policy(model_type, tmp_path / "model", **(config or {}))
    trainer = build_trainer(tmp_path, model=model, max_steps=max_steps, use_vllm=True, vllm_mode="colocate",
                            vllm_max_model_length=64, **args)
    keep_engine(trainer.vllm_generation.llm)
    return trainer


def _engine_prompt_log_probs(llm, prompt: list[int]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
    return torch.tensor([entry[t].logprob for t, entry in zip(prompt[1:], out.prompt_logprobs[1:])])


def _trainer_log_probs(model, tokens: list[int]) -> torch.Tensor:
    import actorcore as ac

    with torch.no_grad(), _without_dropout(model):
        return ac.compute_logprobs(model, ac.pack([torch.tensor(tokens)]), entropy=False).log_probs[1:]


@contextlib.contextmanager
def _without_dropout(model):
    """The policy in eval mode (what the engine computes: no dropout), then in TRL's mode again (one for all of
    its modules: TRL sets it on the whole model)."""
    training = model.training
    model.eval()
    yield
    model.train(training)


def test_trls_own_sync_fails_half_way_and_leaves_the_engine_off_the_policy(tmp_path, monkeypatch, keep_engine):
    trainer = _trl_vllm_trainer("qwen2", tmp_path, monkeypatch, keep_engine)
    model, llm = trainer.model, trainer.vllm_generation.llm
    prompt = [(7 * i + 3) % 131 for i in range(40)]
    torch.testing.assert_close(_engine_prompt_log_probs(llm, prompt), _trainer_log_probs(model, prompt),
                               atol=TOL["engine_vs_actorcore_fp32"], rtol=0)  # the engine starts on the policy
    training_step(model, torch.optim.Adam(model.parameters(), lr=2e-2), seed=1)  # the policy moves
    with pytest.raises(AttributeError, match="weight_loader"):  # the CPU build repacked its linears
        trainer.train()  # the first step syncs through TRL's own sync_weights
    assert (_engine_prompt_log_probs(llm, prompt) - _trainer_log_probs(model, prompt)).abs().max() > FAR


def _lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)


@pytest.mark.parametrize("model_type, lora", [("qwen2", False), ("qwen3_moe", False), ("qwen2", True)],
                         ids=["tied", "moe", "tied-lora"])
def test_patched_sync_keeps_trls_engine_on_the_policy_every_step(model_type, lora, tmp_path, monkeypatch,
                                                                 keep_engine):
    from actorcore.engines import rollout_agreement

    # TRL's MoE load-balancing loss is refused by patch_trainer (trl 1.16 asks for it on any MoE config); LoRA's
    # adapters (lora_B starts at 0) get a larger learning rate, so that two steps move the policy. The policy has
    # attention dropout, which TRL trains with (train mode) and the engine does not run.
    options = dict(peft_config=_lora(), learning_rate=5e-2) if lora else {}
    trainer = _trl_vllm_trainer(model_type, tmp_path, monkeypatch, keep_engine, router_aux_loss_coef=0.0,
                                config=dict(attention_dropout=0.1), **options)
    handle = patch_trainer(trainer)  # engine_sync="auto": on for a colocated engine
    assert handle.engine_sync.value == "VllmBridge" and not handle.engine_sync.explicit
    assert "engine_sync: 'VllmBridge'" in str(handle)
    generation, model = trainer.vllm_generation, trainer.model
    assert hasattr(model, "peft_config") == lora  # TRL wrapped the policy in PEFT: the stream merges the adapters
    trl_generate = generation.generate
    seen = []

    def generate_and_compare(**kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = trl_generate(**kwargs)
        engine_lp = [[lp[0] for lp in seq] for seq in logprobs]
        with _without_dropout(model):
            agreement = rollout_agreement(model, prompt_ids, completion_ids, engine_lp, temperature=TEMPERATURE)
        tokens = list(prompt_ids[0]) + list(completion_ids[0])
        seen.append((handle.trace["trl:engine_syncs"], agreement, (tokens, _trainer_log_probs(model, tokens))))
        return prompt_ids, completion_ids, logprobs, token_ids

    monkeypatch.setattr(generation, "generate", generate_and_compare)
    trainer.train()
    assert [syncs for syncs, _, _ in seen] == [1, 2, 3]  # one sync per step, each before that step's rollouts
    for _, agreement, _ in seen:
        assert agreement.tokens > 0
        for trainer_lp, engine_lp in zip(agreement.log_probs, agreement.engine_log_probs):
            torch.testing.assert_close(trainer_lp, engine_lp, atol=TOL["engine_vs_actorcore_fp32"], rtol=0)
    update = handle.engine_update
    assert update.probe.ok and update.probe.max_abs <= TOL["engine_vs_actorcore_fp32"]
    assert update.reprocessed_shared if model_type == "qwen2" else update.experts_repacked  # the bridge's rerun
    assert handle.trace["trl:calls"] > 0  # the loss's log-probs came from actorcore too
    tokens, at_first_sync = seen[0][2]  # the policy moved between syncs: each sync carried new weights
    assert (_trainer_log_probs(model, tokens) - at_first_sync).abs().max() > TOL["logprob_changed_at_least"]
    handle.revert()
    assert ENGINE_SYNC_METHOD not in generation.__dict__


def test_trls_own_engine_in_bfloat16_trains_on_the_verified_sync(tmp_path, monkeypatch, keep_engine):
    trainer = _trl_vllm_trainer("qwen2", tmp_path, monkeypatch, keep_engine, max_steps=2, float32=False)
    llm = trainer.vllm_generation.llm
    assert llm.llm_engine.model_config.dtype == torch.bfloat16  # vLLM's "auto" for a float32 checkpoint here
    handle = patch_trainer(trainer, engine_sync=True)
    assert handle.engine_sync.explicit
    trainer.train()
    assert handle.trace["trl:engine_syncs"] == 2
    assert handle.engine_update.probe.ok


UNCOVERED = [  # (where TRL keeps a setting of its config, the setting, a value the bridge does not cover, the reason)
    ("generation", "mode", "server", "vllm_mode='server'"),
    ("generation", "enable_sleep_mode", True, "vllm_enable_sleep_mode=True"),
    ("generation", "tensor_parallel_size", 2, "vllm_tensor_parallel_size=2"),
    ("distributed", "zero_stage", 3, "DeepSpeed ZeRO-3"),
    ("distributed", "fsdp_version", 1, "FSDP1"),
    ("vllm", "__version__", "0.33.0", "vLLM 0.33.0 is outside the range"),
]


def test_engine_sync_is_refused_where_the_bridge_does_not_cover_trls_layout(tmp_path, monkeypatch, keep_engine):
    """Each layout the bridge does not cover, on a real colocated trainer with the one attribute TRL would have set
    from its config changed (a server-mode trainer cannot be built without a server): ``True`` is refused with the
    reason, ``"auto"`` keeps TRL's sync and says why; a ``VLLMGeneration`` without what the sync reads is refused
    unless ``engine_sync=False``; a trainer without vLLM has nothing to sync."""
    import vllm

    trainer = _trl_vllm_trainer("qwen2", tmp_path / "vllm", monkeypatch, keep_engine, max_steps=1)
    generation = trainer.vllm_generation
    with pytest.raises(ValueError, match="engine_sync must be True, False or 'auto'"):
        patch_trainer(trainer, engine_sync="on")
    holders = {"generation": generation, "distributed": generation._dist, "vllm": vllm}
    for holder, attribute, value, reason in UNCOVERED:
        with monkeypatch.context() as change:
            change.setattr(holders[holder], attribute, value)
            with pytest.raises(ValueError, match=re.escape(reason)):
                patch_trainer(trainer, engine_sync=True)
            handle = patch_trainer(trainer)
            assert handle.engine_sync.value is False and reason in handle.engine_sync.why
            assert ENGINE_SYNC_METHOD not in generation.__dict__  # TRL's own sync
            handle.revert()
    with monkeypatch.context() as change:
        change.delattr(generation, "_dist")
        with pytest.raises(ValueError, match="is not trl 1.16's VLLMGeneration"):
            patch_trainer(trainer)
        patch_trainer(trainer, engine_sync=False).revert()
    without_vllm = build_trainer(tmp_path / "plain", model=_policy("qwen2", tmp_path / "plain" / "model"))
    with pytest.raises(ValueError, match="use_vllm=False"):
        patch_trainer(without_vllm, engine_sync=True)
    assert "use_vllm=False" in patch_trainer(without_vllm).engine_sync.why
