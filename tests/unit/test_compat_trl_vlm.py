"""TRL's per-token method on Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V with image inputs, on ``patch_trainer``.

TRL's VLM batch (left-padded prompts holding images, right-padded completions; ``pixel_values``,
``image_grid_thw``, ``num_images``, ``mm_token_type_ids``) scored by the patched method equals TRL's own method
per token (log-probs and entropies, fp32 tiny models, temperature 0.7), whole and in TRL's ``batch_size`` chunks
(split by TRL's per-row image counts; TRL's own method fails on a chunk without images, so every chunk here
holds one); the packed path ran (trace). Inputs the patch
cannot split are refused with a ``ValueError``. Not run: ``trainer.train()`` on a VLM (it needs a processor
with a chat template, which the tiny models do not have).
"""

import pytest
import torch

pytest.importorskip("trl", reason="trl not installed (pip install trl==1.16.0)")

from actorcore.compat.trl import patch_trainer  # noqa: E402
from actorcore.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from actorcore.testing.tolerances import TOL  # noqa: E402
from actorcore.testing.trl_cases import build_trainer, trl_own, vlm_rollout  # noqa: E402


def _vlm_trainer(tmp_path, model_type):
    model = build_tiny_vlm(model_type, seed=3, attn_implementation="sdpa")
    return build_trainer(tmp_path, model=model, beta=0.0, per_device_train_batch_size=4, num_generations=2)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_patched_vlm_logps_equal_trls_own_per_token(model_type, tmp_path):
    trainer = _vlm_trainer(tmp_path, model_type)
    inputs = vlm_rollout(trainer.model)
    completion_mask = inputs["attention_mask"][:, -inputs["logits_to_keep"]:]
    handle = patch_trainer(trainer)
    with torch.no_grad():
        for batch_size in (None, 2):  # whole batch; chunks of rows [0, 1], [2, 3], [4]
            want_lp, want_ent, _ = trl_own(trainer, trainer.model, batch_size=batch_size, compute_entropy=True,
                                           **inputs)
            got_lp, got_ent, aux = trainer._get_per_token_logps_and_entropies(
                trainer.model, batch_size=batch_size, compute_entropy=True, **inputs)
            for got, want in ((got_lp, want_lp), (got_ent, want_ent)):
                assert got.shape == want.shape and got.dtype == torch.float32
                assert (got - want).abs().max().item() <= TOL["packed_vs_hf_fp32"]
                assert bool((got[completion_mask == 0] == 0).all())
            assert aux is None
    assert handle.trace["trl:calls"] == 2
    layers = trainer.model.config.get_text_config().num_hidden_layers
    assert handle.trace["attention:actorcore_packed"] == layers * (1 + 3)


def test_vlm_inputs_the_patch_cannot_split_are_refused(tmp_path):
    trainer = _vlm_trainer(tmp_path, "qwen2_5_vl")
    inputs = vlm_rollout(trainer.model)
    patch_trainer(trainer)
    method = trainer._get_per_token_logps_and_entropies
    with pytest.raises(ValueError, match="pixel_values without image_grid_thw"):
        method(trainer.model, **{**inputs, "image_grid_thw": None})
    with pytest.raises(ValueError, match="one image count per row"):
        method(trainer.model, **{**inputs, "num_images": [1, 0, 2]}, batch_size=2)
