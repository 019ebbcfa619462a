"""TRL's own GRPOTrainer / RLOOTrainer on ``actorcore.compat.trl.patch_trainer``, on tiny models on the CPU.

Per token, the patched ``_get_per_token_logps_and_entropies`` equals TRL's own method (fp32 model, temperature
0.7) on the trainer's own rollout batch (left-padded prompts, right-padded completions of varying lengths), with
chunking (``batch_size``), LoRA (TRL's ``peft_config``) and the PEFT reference (adapters disabled);
``trainer.train()`` runs on the patch (with gradient checkpointing) and the patched path is seen to run (trace);
``revert()`` restores TRL's method. Skipped where trl is not installed (``make test`` installs trl==1.16.0).
"""

import pytest
import torch

pytest.importorskip("trl", reason="trl not installed (pip install trl==1.16.0)")

from actorcore.compat.trl import TRAINER_METHOD, patch_trainer  # noqa: E402
from actorcore.testing.trl_cases import build_trainer, rollout as _rollout, trl_own as _trl_own  # noqa: E402
from actorcore.testing.tolerances import TOL  # noqa: E402



def _trainer(tmp_path, kind="grpo", peft_config=None, max_steps=2, **args):
    return build_trainer(tmp_path, kind, peft_config=peft_config, max_steps=max_steps, **args)


def _assert_equal_per_token(got, want, mask):
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert bool((got[mask == 0] == 0).all())


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_patched_logps_equal_trls_own_per_token(kind, tmp_path):
    trainer = _trainer(tmp_path, kind)
    ids, mask, keep = _rollout(trainer)
    handle = patch_trainer(trainer)
    with torch.no_grad():
        want_lp, want_ent, _ = _trl_own(trainer, trainer.model, ids, mask, keep, compute_entropy=True)
        for batch_size in (None, 3):  # whole batch, and TRL's chunking with a smaller last chunk
            got_lp, got_ent, aux = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, keep, batch_size=batch_size, compute_entropy=True)
            _assert_equal_per_token(got_lp, want_lp, mask[:, -keep:])
            _assert_equal_per_token(got_ent, want_ent, mask[:, -keep:])
            assert aux is None
        lp_only = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
    assert lp_only[1] is None and torch.equal(lp_only[0], got_lp)
    assert handle.trace["trl:calls"] == 3
    layers = trainer.model.config.num_hidden_layers
    assert handle.trace["attention:actorcore_packed"] == layers * (1 + 3 + 1)  # one pack per chunk (8 rows in chunks of 3: 3)
    handle.revert()
    assert TRAINER_METHOD not in trainer.__dict__
    with pytest.raises(ValueError, match="already reverted"):
        handle.revert()


def test_grpo_trainer_trains_on_the_patch_with_lora_and_gradient_checkpointing(tmp_path):
    import peft

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    trainer = _trainer(tmp_path, peft_config=lora, max_steps=2, gradient_checkpointing=True)
    ids, mask, keep = _rollout(trainer)
    with torch.no_grad():  # lora_B starts at zero: make the adapters visible, so the reference differs
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    handle = patch_trainer(trainer)
    with torch.no_grad():
        want, _, _ = _trl_own(trainer, trainer.model, ids, mask, keep)
        got, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
        _assert_equal_per_token(got, want, mask[:, -keep:])
        with trainer.model.disable_adapter():  # TRL's PEFT reference
            want_ref, _, _ = _trl_own(trainer, trainer.model, ids, mask, keep)
            got_ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
        _assert_equal_per_token(got_ref, want_ref, mask[:, -keep:])
        assert (got_ref - got).abs().max().item() > TOL["logprob_changed_at_least"]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    calls = handle.trace["trl:calls"]
    trainer.train()
    assert handle.trace["trl:calls"] > calls  # the loss's log-probs (and the reference's) came from actorcore
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and all("lora_" in n for n in moved)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_patch_refusals_and_revert_restores_trls_method(tmp_path):
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="GRPOTrainer or RLOOTrainer"):
        patch_trainer(object())
    handle = patch_trainer(trainer)
    with pytest.raises(ValueError, match="already patched"):
        patch_trainer(trainer)
    ids, mask, keep = _rollout(trainer)
    with pytest.raises(ValueError, match="load-balancing"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_aux_loss=True)
    with pytest.raises(ValueError, match="spatial_shapes"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, spatial_shapes=torch.ones(1, 2))
    handle.revert()
    assert trainer._get_per_token_logps_and_entropies.__func__ is type(trainer).__dict__[TRAINER_METHOD]
    patch_trainer(trainer).revert()  # patching again after a revert is allowed


def test_the_policy_model_takes_the_plan(tmp_path):
    """``patch_trainer`` patches the policy model with ``patch_model``'s plan (its options passed through: here
    selective checkpointing in place of TRL's own), the loss's calls run it (the trace shows the features), and
    ``revert`` removes it; a model patched before keeps its patch."""
    import actorcore as ac

    trainer = _trainer(tmp_path, max_steps=1, gradient_checkpointing=True)
    handle = patch_trainer(trainer, checkpointing="selective")
    assert handle.plan["checkpointing"].explicit and handle.plan["checkpointing"].by == "compat.trl.patch_trainer"
    assert "the model is not on a CUDA device" in handle.plan["compiled_decoder"].why  # the CPU: eager
    trainer.train()
    layers = trainer.model.config.num_hidden_layers
    assert handle.trace["plan:checkpointing"] >= 1 and handle.trace["checkpoint:selective"] >= layers
    handle.revert()
    assert handle.plan is None
    with pytest.raises(TypeError, match="did you mean 'recompute_norms'"):
        patch_trainer(trainer, recompute_norm=True)
    own = ac.patch_model(trainer.model, recompute_norms=True)
    with pytest.raises(ValueError, match="already patched by actorcore"):
        patch_trainer(trainer, checkpointing="full")
    handle = patch_trainer(trainer)
    assert handle.model_patch is None and handle.plan.value("recompute_norms") is True
    handle.revert()
    assert ac.hf.patch.is_patched(trainer.model)
    own.revert()
