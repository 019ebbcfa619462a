"""VLMs, one process: packed M-RoPE batches against the unpatched HF padded forward, per token, for every
registered vision-language architecture; packing; DeepStack; clear errors.

The batch mixes a one-image sequence, a text-only one, a two-image one (different grids), a video one and a
short text-only one. The reference (``actorcore.testing.reference_vlm``) runs each sample alone through the
model's own forward on its own processor-style inputs, sharing no code with the packing under test; actorcore
packs them all together.
"""

import dataclasses

from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.archs import UnsupportedArchitectureError, get_spec, registered_model_types
from actorcore.testing.reference_vlm import reference_logprobs_vlm, sample_inputs
from actorcore.testing.tiny_vlm import (
    IMAGE_TOKEN,
    TINY_VLM_CONFIGS,
    build_tiny_vlm,
    mixed_samples,
    padded_processor_batch,
    synthetic_sample,
)
from actorcore.testing.tolerances import TOL
from actorcore.hf.vlm.packing import pack_multimodal, pack_multimodal_padded

VLM_ARCHS = [m for m in registered_model_types() if get_spec(m).vision is not None and not get_spec(m).vision.refused]
TOL_VLM = TOL["vlm_packed_vs_hf_fp32"]


def _pack(model, samples):
    return pack_multimodal(model, [s.input_ids for s in samples], [s.multimodal for s in samples])


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _tower(model):
    vision = get_spec(model.config.model_type).vision
    return model.get_submodule(f"{vision.base_model}.{vision.tower}")


def _tower_prefix(model):
    vision = get_spec(model.config.model_type).vision
    return f"{vision.base_model}.{vision.tower}."


class _TowerCalls:
    """Counts vision-tower forwards."""

    def __init__(self, model):
        self.count = 0
        self._h = _tower(model).register_forward_hook(lambda *a: setattr(self, "count", self.count + 1))

    def close(self):
        self._h.remove()


def test_every_registered_vlm_has_a_tiny_vlm_config():
    vlms = [m for m in registered_model_types() if get_spec(m).vision is not None and not get_spec(m).vision.refused]
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "kimi_k25"} <= set(vlms)
    missing = [m for m in vlms if m not in TINY_VLM_CONFIGS]
    assert not missing, f"VLM architectures without a tiny config in actorcore.testing.tiny_vlm: {missing}"


@pytest.mark.parametrize("model_type", VLM_ARCHS)
def test_packed_vlm_equals_padded_hf_per_token(model_type):
    model = build_tiny_vlm(model_type)
    samples = mixed_samples(model)
    batch = _pack(model, samples)
    mrope = get_spec(model_type).vision.rope_index is not None  # else plain 1-D positions (Kimi-K2.5)
    assert batch.position_ids.shape == ((3, batch.num_tokens) if mrope else (batch.num_tokens,))
    tower = _TowerCalls(model)
    with torch.no_grad():
        trace = Counter()
        out = ac.compute_logprobs(model, batch, temperature=0.7, trace=trace)
        layers = model.config.text_config.num_hidden_layers  # attention or (hybrid models) linear attention
        assert trace["attention:actorcore_packed"] + trace["linear_attention:actorcore_packed"] == layers
        assert tower.count == 1  # once, for all images and videos together
        ref_lp, ref_ent = reference_logprobs_vlm(model, samples, temperature=0.7)
    tower.close()
    assert out.log_probs.shape == (batch.num_tokens,) and out.log_probs.dtype == torch.float32
    assert _max_diff(out.log_probs, ref_lp) <= TOL_VLM
    assert _max_diff(out.entropy, ref_ent) <= TOL_VLM
    starts = batch.cu_seqlens[:-1].long()
    assert torch.all(out.log_probs[starts] == 0) and torch.all(out.entropy[starts] == 0)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", VLM_ARCHS)
def test_vlm_parameter_gradients_match_padded_hf(model_type):
    model = build_tiny_vlm(model_type, seed=1)
    samples = mixed_samples(model, seed=1)
    batch = _pack(model, samples)
    g = torch.Generator().manual_seed(2)
    w_lp, w_ent = 0.5 + torch.rand(batch.num_tokens, generator=g), 0.5 + torch.rand(batch.num_tokens, generator=g)

    out = ac.compute_logprobs(model, batch)
    ((out.log_probs * w_lp).sum() + (out.entropy * w_ent).sum()).backward()
    packed = _grads(model)
    model.zero_grad(set_to_none=True)
    lp, ent = reference_logprobs_vlm(model, samples)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    want = _grads(model)
    assert packed.keys() == want.keys()
    assert any(name.startswith(_tower_prefix(model)) for name in want)  # the vision tower is trained too
    for name in want:
        rel = ((packed[name] - want[name]).abs().max() / want[name].abs().max().clamp(min=1e-30)).item()
        assert rel <= TOL["grad_packed_vs_hf_fp32_rel"], f"{name}: relative grad difference {rel:.2e}"


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_positions_are_the_models_mrope_per_sequence(model_type):
    model = build_tiny_vlm(model_type)
    samples = mixed_samples(model)
    batch = _pack(model, samples)
    bounds = batch.cu_seqlens.tolist()
    for k, sample in enumerate(samples):  # the model's own position ids for this sample alone
        b = sample_inputs(sample)
        extra = {"second_per_grid_ts": b["second_per_grid_ts"]} if "second_per_grid_ts" in b else {}
        want_3BS, _ = model.model.get_rope_index(
            b["input_ids"], mm_token_type_ids=b["mm_token_type_ids"], image_grid_thw=b.get("image_grid_thw"),
            video_grid_thw=b.get("video_grid_thw"), attention_mask=torch.ones_like(b["input_ids"]), **extra)
        assert torch.equal(batch.position_ids[:, bounds[k]:bounds[k + 1]], want_3BS[:, 0])
    # Image tokens really get 2-D positions (rows differ), and every sequence restarts at 0.
    image = batch.multimodal["mm_token_type_ids"] == 1
    assert not torch.equal(batch.position_ids[1][image], batch.position_ids[2][image])
    assert torch.all(batch.position_ids[:, batch.cu_seqlens[:-1].long()] == 0)


def test_pack_multimodal_padded_equals_per_sequence_packing():
    model = build_tiny_vlm("qwen2_5_vl")
    samples = mixed_samples(model)
    want = _pack(model, samples)
    b = padded_processor_batch(samples)
    for left in (False, True):
        ids, mask, types = b["input_ids"], b["attention_mask"], b["mm_token_type_ids"]
        if left:  # roll every row so its padding comes first
            shifts = (mask == 0).sum(-1).tolist()
            ids, mask, types = (torch.stack([r.roll(s) for r, s in zip(x, shifts)]) for x in (ids, mask, types))
        rest = {k: v for k, v in b.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        got = pack_multimodal_padded(model, ids, mask, mm_token_type_ids=types, **rest)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.position_ids, want.position_ids)
        assert torch.equal(got.cu_seqlens, want.cu_seqlens)
        assert got.multimodal.keys() == want.multimodal.keys()
        for key in want.multimodal:
            assert torch.equal(got.multimodal[key], want.multimodal[key]), key


def test_text_only_batches_skip_the_vision_tower():
    model = build_tiny_vlm("qwen3_vl")
    samples = [synthetic_sample(model, text_lengths=(n,), generator=torch.Generator().manual_seed(n))
               for n in (9, 1, 14)]
    tower = _TowerCalls(model)
    with torch.no_grad():
        ref_lp, ref_ent = reference_logprobs_vlm(model, samples)
        for batch in (_pack(model, samples), pack_multimodal(model, [s.input_ids for s in samples], [None] * 3),
                      ac.pack([s.input_ids for s in samples])):
            out = ac.compute_logprobs(model, batch)
            assert _max_diff(out.log_probs, ref_lp) <= TOL_VLM and _max_diff(out.entropy, ref_ent) <= TOL_VLM
    assert tower.count == 0
    tower.close()


def test_deepstack_and_pixels_reach_the_decoder(monkeypatch):
    """The comparison above can fail: without DeepStack, or with other pixels, the log-probs move."""
    model = build_tiny_vlm("qwen3_vl")
    samples = mixed_samples(model, video=False)
    batch = _pack(model, samples)
    with torch.no_grad():
        base = ac.compute_logprobs(model, batch).log_probs
        other = dataclasses.replace(batch, multimodal={**batch.multimodal,
                                                       "pixel_values": batch.multimodal["pixel_values"] + 1.0})
        assert _max_diff(ac.compute_logprobs(model, other).log_probs, base) > TOL["logprob_changed_at_least"]
        import actorcore.hf.vlm.inputs as vlm

        real = vlm.vlm_decoder_inputs

        def without_deepstack(*args):
            kwargs = real(*args)
            assert "deepstack_visual_embeds" in kwargs and len(kwargs["deepstack_visual_embeds"]) == 2
            return {"inputs_embeds": kwargs["inputs_embeds"]}

        monkeypatch.setattr(vlm, "vlm_decoder_inputs", without_deepstack)
        assert _max_diff(ac.compute_logprobs(model, batch).log_probs, base) > TOL["logprob_changed_at_least"]


# ----- errors -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_vl():
    return build_tiny_vlm("qwen2_vl")


def _one_image(model):
    return synthetic_sample(model, images=[(4, 4)], generator=torch.Generator().manual_seed(3))


def test_image_tokens_not_matching_features_is_an_error(qwen2_vl):
    s = _one_image(qwen2_vl)
    keep = torch.ones_like(s.input_ids, dtype=torch.bool)
    keep[(s.input_ids == IMAGE_TOKEN).nonzero()[0]] = False  # one placeholder fewer than the grid's features
    mm = {**s.multimodal, "mm_token_type_ids": s.multimodal["mm_token_type_ids"][keep]}
    with pytest.raises(ValueError, match="image tokens and features do not match"):
        pack_multimodal(qwen2_vl, [s.input_ids[keep]], [mm])
    with pytest.raises(ValueError, match="image tokens and features do not match"):
        pack_multimodal(qwen2_vl, [s.input_ids], [None])  # placeholders, no pixels
    # Caught at the model too, for a batch assembled by hand.
    with pytest.raises(ValueError, match="image tokens and features do not match"):
        ac.compute_logprobs(qwen2_vl, ac.pack([s.input_ids]))


def test_grids_not_matching_pixels_is_an_error(qwen2_vl):
    s = _one_image(qwen2_vl)
    with pytest.raises(ValueError, match="describe 16 patches but the pixel tensor has 15 rows"):
        pack_multimodal(qwen2_vl, [s.input_ids], [{**s.multimodal, "pixel_values": s.multimodal["pixel_values"][:15]}])
    with pytest.raises(ValueError, match="multiples of the spatial merge size"):
        pack_multimodal(qwen2_vl, [s.input_ids], [{**s.multimodal, "image_grid_thw": torch.tensor([[1, 3, 4]])}])
    batch = _pack(qwen2_vl, [s])
    bad = dataclasses.replace(batch, multimodal={**batch.multimodal, "image_grid_thw": torch.tensor([[1, 2, 4]]),
                                                 "pixel_values": batch.multimodal["pixel_values"][:8]})
    with pytest.raises(ValueError, match="image tokens and features do not match"):
        ac.compute_logprobs(qwen2_vl, bad)
    # and a batch edited after packing is checked again before the tower runs
    bad = dataclasses.replace(batch, multimodal={**batch.multimodal,
                                                 "pixel_values": batch.multimodal["pixel_values"][:15]})
    with pytest.raises(ValueError, match="describe 16 patches but the pixel tensor has 15 rows"):
        ac.compute_logprobs(qwen2_vl, bad)


def test_adjacent_images_without_text_between_is_an_error(qwen2_vl):
    s = synthetic_sample(qwen2_vl, images=[(2, 4), (2, 4)], text_lengths=(3, 0, 2),
                         generator=torch.Generator().manual_seed(4))
    # text_lengths=0 between the images still leaves their end/start markers; drop them to merge the runs
    keep = torch.ones_like(s.input_ids, dtype=torch.bool)
    image = (s.input_ids == IMAGE_TOKEN).nonzero()[:, 0].tolist()
    gap = [i for i in range(image[0], image[-1]) if s.input_ids[i] != IMAGE_TOKEN]
    keep[gap] = False
    mm = {**s.multimodal, "mm_token_type_ids": s.multimodal["mm_token_type_ids"][keep]}
    with pytest.raises(ValueError, match=r"runs have lengths \[4\] but the grids need \[2, 2\]"):
        pack_multimodal(qwen2_vl, [s.input_ids[keep]], [mm])


def test_bad_inputs_are_errors(qwen2_vl):
    s = _one_image(qwen2_vl)
    with pytest.raises(ValueError, match="unknown multimodal inputs"):
        pack_multimodal(qwen2_vl, [s.input_ids], [{**s.multimodal, "pixel_mask": torch.ones(3)}])
    with pytest.raises(ValueError, match="one dict"):
        pack_multimodal(qwen2_vl, [s.input_ids], [])
    types = s.multimodal["mm_token_type_ids"].clone()
    types[0] = 1
    with pytest.raises(ValueError, match="not all the image placeholder token"):
        pack_multimodal(qwen2_vl, [s.input_ids], [{**s.multimodal, "mm_token_type_ids": types}])
    glm = build_tiny_vlm("glm4v")
    v = synthetic_sample(glm, video=(2, 4, 4))
    with pytest.raises(ValueError, match="pass the processor's mm_token_type_ids"):
        pack_multimodal(glm, [v.input_ids], [{k: x for k, x in v.multimodal.items() if k != "mm_token_type_ids"}])
    from actorcore.testing.tiny_configs import build_tiny_model

    with pytest.raises(ValueError, match="text model"):
        pack_multimodal(build_tiny_model("qwen2"), [s.input_ids], [None])


def test_kimi_vl_is_refused_with_the_reason():
    from types import SimpleNamespace

    from actorcore.archs import spec_for_model

    fake = SimpleNamespace(config=SimpleNamespace(model_type="kimi_vl"))
    with pytest.raises(UnsupportedArchitectureError, match="Kimi-VL is not shipped by the installed transformers"):
        spec_for_model(fake)
    with pytest.raises(UnsupportedArchitectureError, match="not shipped"):
        pack_multimodal(fake, [torch.tensor([3, 4])], [None])


def test_demo_vlm_row_agrees_with_hf():
    from actorcore.cli.demo_vlm import vlm_row

    row = vlm_row(seed=1)
    assert row["sequences"] == 3 and row["tokens"] > 0 and row["seconds"] > 0
    assert row["max_abs_diff_logprob"] <= TOL_VLM and row["max_abs_diff_entropy"] <= TOL_VLM
    assert row["tolerance"] == TOL_VLM


@pytest.mark.parametrize("model_type", ["qwen3_vl", "kimi_k25"])  # kimi_k25: [P, 3, p, p] pixel rows, (h, w) kernel
def test_text_only_batch_runs_a_dummy_image_when_ranks_may_disagree(monkeypatch, model_type):
    """With a sharded tower (FSDP2) or a data-parallel axis, a text-only batch still runs the tower (collectives
    match on every rank), its features enter multiplied by 0: same outputs, zero (not missing) tower grads."""
    import actorcore.hf.vlm.inputs as vlm

    model = build_tiny_vlm(model_type)
    samples = [synthetic_sample(model, text_lengths=(n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4)]
    batch = _pack(model, samples)
    with torch.no_grad():
        ref_lp, ref_ent = reference_logprobs_vlm(model, samples)
    assert not vlm.tower_must_run(model.model, get_spec(model_type).vision, None)
    monkeypatch.setattr(vlm, "tower_must_run", lambda *a: True)
    tower = _TowerCalls(model)
    out = ac.compute_logprobs(model, batch)
    assert tower.count == 1
    tower.close()
    assert torch.equal(out.log_probs, ac.compute_logprobs(model, batch).log_probs)
    assert _max_diff(out.log_probs, ref_lp) <= TOL_VLM and _max_diff(out.entropy, ref_ent) <= TOL_VLM
    (out.log_probs.sum() + out.entropy.sum()).backward()
    tower_grads = [p.grad for n, p in model.named_parameters() if n.startswith(_tower_prefix(model))]
    assert tower_grads and all(g is not None and not bool(g.any()) for g in tower_grads)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_critic_values_match_padded_hf(model_type):
    """A VLM critic (transformers has no ...VL ForTokenClassification): the conditional-generation model with a
    1-output ``score`` head; values are the head on the decoder's last hidden state."""
    model = build_tiny_vlm(model_type, seed=2)
    torch.manual_seed(3)
    model.score = torch.nn.Linear(model.config.text_config.hidden_size, 1)
    samples = mixed_samples(model, seed=2)
    with torch.no_grad():
        values = ac.compute_values(model, _pack(model, samples))
        b = padded_processor_batch(samples)
        hidden = model.model(**b, use_cache=False).last_hidden_state
        want = model.score(hidden.float())[..., 0][b["attention_mask"].bool()]
    assert values.shape == want.shape and _max_diff(values, want) <= TOL_VLM


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")  # 5.24 renamed it; 5.17 has only this
def test_gradient_checkpointing_vlm_matches():
    model = build_tiny_vlm("qwen3_vl", seed=4)
    samples = mixed_samples(model, seed=4)
    batch = _pack(model, samples)
    grads = []
    for checkpointing in (False, True):
        model.zero_grad(set_to_none=True)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()  # HF checkpoints only in training mode; the tiny configs have no dropout
        trace = Counter()
        out = ac.compute_logprobs(model, batch, trace=trace)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        layers = model.config.text_config.num_hidden_layers
        assert trace["attention:actorcore_packed"] == layers * (2 if checkpointing else 1)  # recomputed in backward
        grads.append(_grads(model))
    for name, want in grads[0].items():
        rel = ((grads[1][name] - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
        assert rel <= TOL["grad_packed_vs_hf_fp32_rel"], f"{name}: {rel:.2e}"


def test_pack_and_pack_padded_take_multimodal_inputs():
    model = build_tiny_vlm("qwen2_vl")
    samples = mixed_samples(model)
    want = _pack(model, samples)
    b = padded_processor_batch(samples)
    rest = {k: v for k, v in b.items() if k not in ("input_ids", "attention_mask")}
    for got in (ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=model),
                ac.pack_padded(b["input_ids"], b["attention_mask"], model=model, **rest)):
        assert torch.equal(got.position_ids, want.position_ids) and torch.equal(got.input_ids, want.input_ids)
        assert all(torch.equal(got.multimodal[k], want.multimodal[k]) for k in want.multimodal)
    with pytest.raises(ValueError, match="need model"):
        ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples])
    with pytest.raises(ValueError, match="need model"):
        ac.pack_padded(b["input_ids"], b["attention_mask"], **rest)
