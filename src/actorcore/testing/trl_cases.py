"""TRL trainers on tiny models for the tests of ``actorcore.compat.trl`` (one rank, several gloo ranks, VLMs).

Everything here builds TRL's own objects (``GRPOTrainer`` / ``RLOOTrainer``, its rollout batch) with no download:
a WordLevel tokenizer over the tiny vocabulary, five prompts of different lengths (so every batch is left-padded),
a cheap reward, and a tiny Qwen2 whose end-of-sequence is likely enough that completions end at different lengths
(so the batch is right-padded too). TRL's own per-token method is reached through the class, past the patch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from actorcore.testing.tiny_configs import build_tiny_model

VOCAB = 131
TEMPERATURE = 0.7
TRAINER_METHOD = "_get_per_token_logps_and_entropies"


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def dataset(count: int = 5):
    """``count`` prompts of 2, 3, ... tokens: any two differ in length, so every batch carries left padding."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(11)
    prompts = [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (2 + k % 5,), generator=g))
               for k in range(count)]
    return Dataset.from_dict({"prompt": prompts})


def reward(completions, **_):
    """Share of even word ids: a cheap, verifiable toy reward."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w.startswith("w")) / max(1, len(c.split()))
            for c in completions]


def make_eos_likely(model) -> None:
    """Point the eos row of the lm head along the mean hidden state (about 0.1 per step at temperature 0.7), so
    that completions end at varying lengths and the batch carries right padding as well as left padding."""
    with torch.no_grad():
        ids = torch.randint(3, VOCAB, (64, 6), generator=torch.Generator().manual_seed(0))
        mean = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[1] = mean / mean.norm() ** 2


def tiny_policy(directory: Path, save: bool = True):
    """The tiny fp32 Qwen2 (sdpa), saved to ``directory``: without PEFT, TRL loads its reference from the path
    (several ranks: one saves, the others pass ``save=False`` and wait for it)."""
    model = build_tiny_model("qwen2", seed=4, attn_implementation="sdpa")
    model.config.eos_token_id, model.config.pad_token_id = 1, 0
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    make_eos_likely(model)
    if save:
        model.save_pretrained(directory)
    model.config._name_or_path = str(directory)
    return model


def build_trainer(directory: Path, kind: str = "grpo", peft_config: Any = None, max_steps: int = 2, model: Any = None,
                  per_device_train_batch_size: int = 8, num_generations: int = 4, prompts: int = 5, **args: Any):
    """TRL's trainer (fp32, temperature 0.7, beta 0.1) on ``model`` or the tiny Qwen2 saved under ``directory``."""
    import trl

    directory = Path(directory)
    model = tiny_policy(directory / "model") if model is None else model
    config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    settings = dict(output_dir=str(directory / "out"), use_cpu=True, report_to=[], max_steps=max_steps,
                    per_device_train_batch_size=per_device_train_batch_size, num_generations=num_generations,
                    max_completion_length=8, temperature=TEMPERATURE, beta=0.1, learning_rate=1e-3, bf16=False,
                    logging_steps=1, save_strategy="no", seed=0)
    config = config_cls(**{**settings, **args})
    return trainer_cls(model=model, reward_funcs=reward, args=config, train_dataset=dataset(prompts),
                       processing_class=tokenizer(), peft_config=peft_config)


def rollout(trainer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's own rollout batch: its generation, its padding; returns (ids, mask, logits_to_keep)."""
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    assert (inputs["prompt_mask"] == 0).any() and (inputs["completion_mask"] == 0).any(), "no padding to pack"
    return ids, mask, inputs["completion_ids"].shape[1]


def trl_own(trainer, *args: Any, **kwargs: Any):
    """TRL's own ``_get_per_token_logps_and_entropies`` of the trainer's class (past any patch on the instance)."""
    return type(trainer).__dict__.get(TRAINER_METHOD, getattr(type(trainer), TRAINER_METHOD))(trainer, *args, **kwargs)


def vlm_rollout(model, seed: int = 0) -> dict[str, Any]:
    """A rollout batch in TRL's VLM layout: prompts with images (one, none, two of different shapes, none, one)
    left-padded, text completions of different lengths right-padded; image inputs concatenated in row order with
    TRL's ``num_images`` (images per row) and ``[B, S]`` ``mm_token_type_ids``. Returns the method's keywords
    (``input_ids``, ``attention_mask``, ``logits_to_keep``, ``pixel_values``, ``image_grid_thw``, ``num_images``,
    ``mm_token_type_ids``)."""
    from actorcore.hf.embedded import TEXT_VOCAB, synthetic_sample

    g = torch.Generator().manual_seed(seed)
    images = [[(4, 4)], [], [(4, 6), (2, 4)], [], [(2, 2)]]
    prompts = [synthetic_sample(model, images=shapes, text_lengths=(3 + i, 2), generator=g)
               for i, shapes in enumerate(images)]
    completions = [torch.randint(3, TEXT_VOCAB, (n,), generator=g) for n in (6, 2, 4, 1, 5)]
    prompt_len, keep = max(p.input_ids.numel() for p in prompts), max(c.numel() for c in completions)
    rows = len(prompts)
    ids = torch.zeros((rows, prompt_len + keep), dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        n = p.input_ids.numel()
        ids[b, prompt_len - n:prompt_len], mask[b, prompt_len - n:prompt_len] = p.input_ids, 1
        types[b, prompt_len - n:prompt_len] = p.multimodal["mm_token_type_ids"]
        ids[b, prompt_len:prompt_len + c.numel()], mask[b, prompt_len:prompt_len + c.numel()] = c, 1
    with_images = [p.multimodal for p in prompts if "pixel_values" in p.multimodal]
    return dict(input_ids=ids, attention_mask=mask, logits_to_keep=keep, mm_token_type_ids=types,
                pixel_values=torch.cat([m["pixel_values"] for m in with_images]),
                image_grid_thw=torch.cat([m["image_grid_thw"] for m in with_images]),
                num_images=[len(shapes) for shapes in images])
