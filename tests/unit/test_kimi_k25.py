"""Kimi-K2.5 (``kimi_k25``): a MoonViT tower and projector on a DeepSeek-V3 text model (MLA with yarn mscale,
MoE), plain 1-D positions, pixels as ``[patches, 3, p, p]``, a grid's frames pooled into one placeholder run,
no ``mm_token_type_ids``, tied output layer.

The per-token comparison with the padded HF forward and the parameter gradients (vision tower included) are the
generic tests of ``test_vlm.py``, which run for every registered VLM; this file checks what is particular to it
against the model's own one-sequence forward (``ac.verify``).
"""

import dataclasses
from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.archs import get_spec
from actorcore.testing.tiny_vlm import (
    VIDEO_TOKEN,
    build_tiny_vlm,
    mixed_samples,
    padded_processor_batch,
    synthetic_sample,
)
from actorcore.testing.tolerances import TOL


@pytest.fixture(scope="module")
def kimi():
    return build_tiny_vlm("kimi_k25", seed=5)


def _pack(model, samples):
    return ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=model)


class _TowerCalls:
    def __init__(self, model):
        self.count = 0
        self._h = model.model.vision_tower.register_forward_hook(lambda *a: setattr(self, "count", self.count + 1))

    def close(self):
        self._h.remove()


def test_verify_passes_on_images_videos_and_text(kimi):
    samples = mixed_samples(kimi, seed=6)
    assert all("mm_token_type_ids" not in s.multimodal for s in samples)  # as its processor: none
    batch = _pack(kimi, samples)
    trace = Counter()
    with torch.no_grad():
        ac.compute_logprobs(kimi, batch, trace=trace)
    assert trace["attention:actorcore_packed"] == kimi.config.text_config.num_hidden_layers
    report = ac.verify(kimi, batch, temperature=0.7, strict=True)
    assert report.ok and report.sequences == len(samples) and report.tokens == batch.num_tokens - len(samples)
    assert report.tolerance == TOL["vlm_packed_vs_hf_fp32"]


def test_positions_are_plain_1d_per_sequence(kimi):
    samples = mixed_samples(kimi, seed=7)
    batch = _pack(kimi, samples)
    want = torch.cat([torch.arange(s.input_ids.numel()) for s in samples])
    assert torch.equal(batch.position_ids, want)
    # a padded processor batch (no mm_token_type_ids: derived from the placeholder ids) packs the same
    b = padded_processor_batch(samples)
    assert "mm_token_type_ids" not in b
    padded = ac.pack_padded(b.pop("input_ids"), b.pop("attention_mask"), model=kimi, **b)
    assert torch.equal(padded.input_ids, batch.input_ids) and torch.equal(padded.position_ids, want)
    assert padded.multimodal.keys() == batch.multimodal.keys()
    assert all(torch.equal(padded.multimodal[k], batch.multimodal[k]) for k in batch.multimodal)
    # a grid's t frames are pooled into h*w/merge² features: the [2, 4, 4] video is 4 placeholders, not 8
    video = next(s for s in samples if "video_grid_thw" in s.multimodal)
    assert int((video.input_ids == VIDEO_TOKEN).sum()) == 4 and video.multimodal["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert tuple(batch.multimodal["pixel_values"].shape[1:]) == (3, 4, 4)


def test_text_only_batches_skip_the_tower_and_match_the_model(kimi):
    samples = [synthetic_sample(kimi, text_lengths=(n,), generator=torch.Generator().manual_seed(n)) for n in (9, 1, 14)]
    ids = [s.input_ids for s in samples]
    tower = _TowerCalls(kimi)
    batches = (_pack(kimi, samples), ac.pack(ids, multimodal=[None] * 3, model=kimi), ac.pack(ids))
    for batch in batches:
        assert torch.equal(batch.position_ids, batches[-1].position_ids)
        ac.verify(kimi, batch, strict=True)
    assert tower.count == 0
    tower.close()


def _same_per_sequence(a, b, batch):
    bounds = batch.cu_seqlens.tolist()
    return [torch.equal(a.log_probs[s:e], b.log_probs[s:e]) and torch.equal(a.entropy[s:e], b.entropy[s:e])
            for s, e in zip(bounds[:-1], bounds[1:])]


def test_packing_isolation_is_bitwise(kimi):
    """Changing one sequence's tokens, or one image's pixels, leaves every other sequence bitwise unchanged."""
    samples = mixed_samples(kimi, seed=8)
    batch = _pack(kimi, samples)
    text_ids = [s.input_ids.clone() for s in samples]
    text_ids[1] = torch.randint(3, 118, text_ids[1].shape, generator=torch.Generator().manual_seed(99))
    changed_text = ac.pack(text_ids, multimodal=[s.multimodal for s in samples], model=kimi)
    pixels = batch.multimodal["pixel_values"].clone()
    pixels[:16] += 1.0  # the first sequence's image
    changed_image = dataclasses.replace(batch, multimodal={**batch.multimodal, "pixel_values": pixels})
    with torch.no_grad():
        base = ac.compute_logprobs(kimi, batch, temperature=0.8)
        for changed, which in ((changed_text, 1), (changed_image, 0)):
            out = ac.compute_logprobs(kimi, changed, temperature=0.8)
            assert _same_per_sequence(base, out, batch) == [i != which for i in range(len(samples))], which


def test_mscale_reaches_the_packed_attention(kimi):
    """The yarn mscale enters as the attention module's ``scaling`` (not 1/sqrt(qk head dim)); the packed
    attention uses it: with the plain scale the log-probs move beyond what verify accepts, with the model's
    they equal its forward (``test_verify_passes_on_images_videos_and_text``)."""
    tc = kimi.config.text_config
    attention = [layer.self_attn for layer in kimi.model.language_model.layers]
    plain = (tc.qk_nope_head_dim + tc.qk_rope_head_dim) ** -0.5
    assert all(abs(a.scaling / plain - 1) > 0.05 for a in attention)
    assert kimi.lm_head.weight is kimi.get_input_embeddings().weight  # tied, as the model's default
    batch = _pack(kimi, mixed_samples(kimi, seed=9, video=False))
    with torch.no_grad():
        want = ac.compute_logprobs(kimi, batch).log_probs
        scales = [a.scaling for a in attention]
        try:
            for a in attention:
                a.scaling = plain
            moved = ac.compute_logprobs(kimi, batch).log_probs
        finally:
            for a, s in zip(attention, scales):
                a.scaling = s
    assert (moved - want).abs().max().item() > TOL["logprob_changed_by_attention_scale_at_least"]


def test_inputs_in_another_models_layout_are_errors(kimi):
    s = synthetic_sample(kimi, images=[(4, 4)], video=(2, 4, 4), generator=torch.Generator().manual_seed(3))
    flat = {**s.multimodal, "pixel_values": s.multimodal["pixel_values"].flatten(1)}  # Qwen's [P, C*p*p] rows
    with pytest.raises(ValueError, match=r"pixel rows have shape \(48,\) but this model's vision tower takes rows of "
                                         r"shape \(3, 4, 4\)"):
        ac.pack([s.input_ids], multimodal=[flat], model=kimi)
    batch = _pack(kimi, [s])
    bad = dataclasses.replace(batch, multimodal={**batch.multimodal, "pixel_values": flat["pixel_values"]})
    with pytest.raises(ValueError, match="pixel rows have shape"):
        ac.compute_logprobs(kimi, bad)
    # Qwen's count for a [2, 4, 4] video (t*h*w/merge² = 8 placeholders) does not fit a frame-pooling tower
    video = (s.input_ids == VIDEO_TOKEN).nonzero()[:, 0]
    ids = torch.cat([s.input_ids[: video[-1] + 1], torch.full((4,), VIDEO_TOKEN), s.input_ids[video[-1] + 1:]])
    with pytest.raises(ValueError, match="4 features: video tokens and features do not match"):
        ac.pack([ids], multimodal=[s.multimodal], model=kimi)


def test_spec_states_the_kimi_facts():
    spec = get_spec("kimi_k25")
    assert spec.mlp_kind == "moe" and spec.head == () and not spec.mcore.refused
    assert spec.vision.rope_index is None and spec.vision.frames_pooled and spec.vision.patch_row == "image"
    assert not spec.vision.token_types_input


def test_save_pretrained_writes_the_names_the_megatron_rules_read(tmp_path):
    """The Megatron rules' checkpoint layout is what the installed transformers writes: the tower's attention
    fused (``wqkv`` = q and k with their RoPE rows interleaved per head, then v), not q/k/v, and the language
    model under ``language_model.model.blocks.*``; every saved tensor is named by exactly one rule."""
    from safetensors.torch import load_file

    kimi = build_tiny_vlm("kimi_k25", seed=5)
    with torch.no_grad():  # the attention biases start at 0; random ones show their permutation too
        for name, param in kimi.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    kimi.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any(".q_proj." in n and "vision_tower" in n for n in saved)
    assert any(n.startswith("language_model.model.blocks.0.") for n in saved)
    heads = kimi.config.vision_config.num_attention_heads

    def interleave(t):  # rows [h, (half, half)] -> [h, (pairs)]: each head's two rotary halves zipped
        head_dim = t.shape[0] // heads
        return t.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(t.shape)

    for i, block in enumerate(kimi.model.vision_tower.layers):
        attn = block.attn
        for kind in ("weight", "bias"):
            q, k, v = (getattr(getattr(attn, p), kind) for p in ("q_proj", "k_proj", "v_proj"))
            fused = saved[f"vision_tower.encoder.blocks.{i}.wqkv.{kind}"]
            assert torch.equal(fused, torch.cat([interleave(q), interleave(k), v]).reshape(fused.shape))
            assert not torch.equal(fused, torch.cat([q, k, v]))  # the permutation is not the identity here
    rules = get_spec("kimi_k25").mcore
    assert not rules.refused
    assert all(len(rules.rules_for_hf(n)) == 1 for n in saved), [n for n in saved if len(rules.rules_for_hf(n)) != 1]
