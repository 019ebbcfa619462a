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


def _kimi_with_random_biases(**overrides):
    """The tiny Kimi-K2.5 with random attention biases (they start at 0; random ones show their permutation)."""
    kimi = build_tiny_vlm("kimi_k25", seed=5, **overrides)
    with torch.no_grad():
        for name, param in kimi.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    return kimi


def _interleave(t, heads):
    """Rows [h, (half, half)] -> [h, (pairs)]: each head's two rotary halves zipped (the checkpoint's q/k rows)."""
    head_dim = t.shape[0] // heads
    return t.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(t.shape)


def test_the_megatron_rules_name_the_release_tensors(tmp_path):
    """The Megatron rules read and write the release's names (``support/kimi_release.RELEASE_NAMES``, read off vLLM's,
    SGLang's and Megatron-Bridge's loaders, not off the rules): every tensor of a tiny checkpoint under those names,
    the untied output layer included, is named by exactly one rule, every rule names one of them, and the
    checkpoint needs no renaming (export writes what the rules name). The tower's attention is the fused ``wqkv``:
    q and k with their rotary rows interleaved per head, then v."""
    from safetensors.torch import load_file

    from support.kimi_release import RELEASE_NAMES, name_pattern, save_release_checkpoint

    kimi = _kimi_with_random_biases(tie_word_embeddings=False)
    names = save_release_checkpoint(kimi, str(tmp_path))
    assert {name_pattern(n) for n in names} == RELEASE_NAMES  # the tiny model has every kind of tensor
    rules = get_spec("kimi_k25").mcore
    assert rules.for_checkpoint(names) is rules
    assert [n for n in names if len(rules.rules_for_hf(n)) != 1] == []
    assert [r.mcore_name for r in rules.rules if not any(r.match_hf(n) is not None for n in names)] == []
    saved, heads = load_file(str(tmp_path / "model.safetensors")), kimi.config.vision_config.num_attention_heads
    for i, block in enumerate(kimi.model.vision_tower.layers):
        for kind in ("weight", "bias"):
            q, k, v = (getattr(getattr(block.attn, p), kind) for p in ("q_proj", "k_proj", "v_proj"))
            fused = saved[f"vision_tower.encoder.blocks.{i}.wqkv.{kind}"]
            assert torch.equal(fused, torch.cat([_interleave(q, heads), _interleave(k, heads), v]).reshape(fused.shape))
            assert not torch.equal(fused, torch.cat([q, k, v]))  # the permutation is not the identity here


def test_the_megatron_rules_read_save_pretrained_names_too(tmp_path):
    """transformers' save_pretrained writes three prefixes otherwise than the release (``language_model.model.blocks``,
    ``vision_tower.encoder.patch_embed.proj``, ``model.mm_projector.pre_norm``); such a checkpoint is read under those
    names (every tensor by exactly one rule), and they are exactly the release's names renamed."""
    from safetensors.torch import load_file

    from support.kimi_release import release_name

    build_tiny_vlm("kimi_k25", seed=5).save_pretrained(str(tmp_path))
    saved = sorted(load_file(str(tmp_path / "model.safetensors")))
    assert any(n.startswith("language_model.model.blocks.0.") for n in saved)
    rules = get_spec("kimi_k25").mcore.for_checkpoint(saved)
    assert [n for n in saved if len(rules.rules_for_hf(n)) != 1] == []
    release = {r.mcore_name: r for r in get_spec("kimi_k25").mcore.rules}
    for name in saved:
        (rule, indices), = rules.rules_for_hf(name)
        assert release_name(name) in release[rule.mcore_name].hf_names_for(indices), name


def test_transformers_loads_the_release_names(tmp_path):
    """The HF route loads the release through transformers' own from_pretrained (its kimi_k25 conversion mapping):
    a tiny checkpoint under the release's names gives every parameter bitwise, nothing missing or unexpected, and
    actorcore's packed log-probs equal the original model's own forward, one sequence at a time."""
    from transformers import AutoModelForImageTextToText

    from support.kimi_release import save_release_checkpoint
    from actorcore.testing.reference_vlm import reference_logprobs_vlm

    kimi = _kimi_with_random_biases(tie_word_embeddings=False)
    save_release_checkpoint(kimi, str(tmp_path))
    loaded, info = AutoModelForImageTextToText.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                               output_loading_info=True)
    assert not any(info.values()), info
    want = dict(kimi.named_parameters())
    assert sorted(want) == sorted(n for n, _ in loaded.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in loaded.named_parameters())
    samples = mixed_samples(kimi, seed=10)
    batch = _pack(loaded.eval(), samples)
    with torch.no_grad():
        got = ac.compute_logprobs(loaded, batch)
        ref = torch.cat([reference_logprobs_vlm(kimi, [s])[0] for s in samples])
    torch.testing.assert_close(got.log_probs, ref, atol=TOL["vlm_packed_vs_hf_fp32"], rtol=0)


@pytest.mark.parametrize("config_holder", ["both", "text"])
def test_the_int4_release_is_refused_on_the_megatron_route(tmp_path, config_holder):
    """The release's INT4 experts are not dequantized on the Megatron route: the reader refuses the checkpoint,
    naming the packed tensors and what to do, instead of reporting each expert as missing."""
    from actorcore.errors import CheckpointError
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader
    from support.kimi_release import save_release_checkpoint, with_int4_experts

    save_release_checkpoint(build_tiny_vlm("kimi_k25", seed=5, tie_word_embeddings=False), str(tmp_path))
    with_int4_experts(str(tmp_path), config_holder)
    with pytest.raises(CheckpointError, match=r"12 weights are stored quantized and packed by compressed-tensors "
                       r"\(quantization_config: quant_method 'compressed-tensors', format 'pack-quantized'; e\.g\. "
                       r"language_model\.model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight_packed .*"
                       r"dequantize the checkpoint first .*CompressedTensorsConfig\(dequantize=True\)"):
        SafetensorsReader(str(tmp_path))


def test_a_model_left_compressed_by_compressed_tensors_is_refused(kimi):
    """transformers with compressed-tensors loads the INT4 release compressed unless asked to dequantize; it then
    holds a ``hf_quantizer`` whose config says so (seen with compressed-tensors 0.20 on a tiny INT4 checkpoint: the
    vision tower and projector came out at their random initialisation, the load report listing them MISSING).
    The HF route refuses such a model; a dequantized one has no quantizer left and runs."""
    from types import SimpleNamespace

    batch = _pack(kimi, mixed_samples(kimi, seed=6, video=False))
    method = SimpleNamespace(value="compressed-tensors")  # transformers' QuantizationMethod.COMPRESSED_TENSORS
    for dequantize in (False, True):
        config = SimpleNamespace(quant_method=method, dequantize=dequantize, is_quantization_compressed=True)
        kimi.hf_quantizer = SimpleNamespace(quantization_config=config)
        try:
            if dequantize:
                with torch.no_grad():
                    ac.compute_logprobs(kimi, batch)
            else:
                with pytest.raises(ValueError, match=r"holds compressed-tensors quantized weights .*"
                                   r"CompressedTensorsConfig\(dequantize=True\)"):
                    ac.compute_logprobs(kimi, batch)
        finally:
            del kimi.hf_quantizer


def test_an_export_config_claims_no_quantization(tmp_path):
    """transformers, dequantizing the release on load, drops its top-level quantization_config but keeps
    text_config's, which vLLM's Kimi-K2.5 config takes as the model's: the export of unquantized weights writes
    neither."""
    from transformers import AutoConfig

    from actorcore.export.mxfp4 import without_quantization_config
    from support.kimi_release import save_release_checkpoint, with_int4_experts

    save_release_checkpoint(build_tiny_vlm("kimi_k25", seed=5), str(tmp_path))
    with_int4_experts(str(tmp_path), "text")
    config = AutoConfig.from_pretrained(str(tmp_path))
    assert "quantization_config" in config.to_dict()["text_config"]
    exported = without_quantization_config(config).to_dict()
    assert "quantization_config" not in exported and "quantization_config" not in exported["text_config"]
    assert "quantization_config" in config.to_dict()["text_config"]  # a copy: the caller's config is unchanged
