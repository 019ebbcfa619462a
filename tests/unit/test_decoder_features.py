"""The decoder-feature protocol: every feature checks after the call that it ran, and a bypassed one raises its
``FastPathNotRunError`` subclass (negative controls for the features whose bypass no other test covers: packed
and linear attention, offload, tiled MLP and recomputed norms have theirs next to their tests); a new feature is
one object in one list, entered around the forward, installed by ``patch_model`` and checked after every call."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.errors import (
    BatchInvariantNotAppliedError,
    FastPathNotRunError,
    FiniteCheckNotRunError,
    VisionInputsNotAppliedError,
)
from actorcore.hf.call import DecoderCall
from actorcore.hf.features.base import DecoderFeature, entry_order, patch_trace_bound
from actorcore.hf.features import DECODER_FEATURES
from actorcore.hf.features.instance_forwards import install_forwards, wrapped_forward
from actorcore.hf.features.plan import Conflict, FeatureOption
from actorcore.testing.reference import reference_logprobs, right_padded
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL


def _sequences():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 131, (n,), generator=g) for n in (7, 12, 3)]


def _batch():
    return ac.pack(_sequences())


def _nothing(*args, **kwargs):
    return contextlib.nullcontext()


def test_every_error_of_the_family_is_a_fast_path_error():
    for error in (BatchInvariantNotAppliedError, FiniteCheckNotRunError, VisionInputsNotAppliedError):
        assert issubclass(error, FastPathNotRunError)


def test_bypassed_batch_invariant_forwards_are_an_error(monkeypatch):
    model = build_tiny_model("llama")
    ac.compute_logprobs(model, _batch(), batch_invariant=True)  # runs when nothing bypasses it
    monkeypatch.setattr("actorcore.hf.features.batch_invariant.batch_invariant_decoder", _nothing)
    with pytest.raises(BatchInvariantNotAppliedError, match="batch-invariant linears did not run in 14 linears"):
        ac.compute_logprobs(model, _batch(), batch_invariant=True)


def test_bypassed_finite_checks_are_an_error(monkeypatch):
    model = build_tiny_model("llama")
    trace = Counter()
    ac.compute_logprobs(model, _batch(), check_finite=True, trace=trace)
    assert trace["finite:checked"] == 1 + model.config.num_hidden_layers  # the embedding and every layer
    monkeypatch.setattr("actorcore.hf.features.finite.finite_checks", _nothing)
    with pytest.raises(FiniteCheckNotRunError, match="finite checks ran 0 times for 2 decoder layers"):
        ac.compute_logprobs(model, _batch(), check_finite=True)


def test_vlm_decoder_that_ignores_the_merged_embeddings_is_an_error(monkeypatch):
    import actorcore.hf.vlm.inputs as vlm
    from actorcore.hf.features.vision_inputs import EMBEDDED_IDS_KEY, INPUTS_EMBEDS_KEY
    from actorcore.hf.vlm.packing import pack_multimodal
    from actorcore.testing.tiny_vlm import build_tiny_vlm, synthetic_sample

    model = build_tiny_vlm("qwen2_vl")
    g = torch.Generator().manual_seed(0)
    samples = [synthetic_sample(model, images=[(4, 4)], text_lengths=(6, 9), generator=g)]
    batch = pack_multimodal(model, [s.input_ids for s in samples], [s.multimodal for s in samples])
    trace = Counter()
    with torch.no_grad():
        ac.compute_logprobs(model, batch, trace=trace)
    assert (trace[INPUTS_EMBEDS_KEY], trace[EMBEDDED_IDS_KEY]) == (1, 0)
    monkeypatch.setattr(vlm, "vlm_decoder_inputs", lambda *args: {})  # the decoder embeds the token ids itself
    with pytest.raises(VisionInputsNotAppliedError, match="did not run on the embeddings with the visual features"):
        with torch.no_grad():
            ac.compute_logprobs(model, batch)


class _ScaledFinalNorm:
    """An instance forward of the decoder's final norm, for the patch's lifetime: the norm's output times a scale."""

    def __init__(self, norm, previous, trace, scale):
        self.norm, self.previous, self.trace, self.scale = norm, previous, trace, scale

    def __call__(self, hidden_states):
        if self.trace.counts is not None:
            self.trace.counts["example:final_norm"] += 1
        return wrapped_forward(self.norm, self.previous)(hidden_states) * self.scale


class _ExampleScale(FeatureOption):
    """``example_scale``: "auto", False or a float. ``"auto"`` reads a fact (the model's dtype) and another
    feature's decision (tiled MLP): 1.0 on an fp32 model whose MLPs are tiled, else off."""

    name = "example_scale"
    keywords = {"example_scale": "auto"}
    needs = ("tiled_mlp_shards",)
    conflicts = (Conflict("recompute_norms", holds=lambda mine, other, decided, facts: mine.on and other.on,
                          why="both replace the final norm's forward", instead="example_scale=False"),)
    doc = "the final norm's output times this scale (an example)."

    def resolve(self, asked, facts, decided):
        scale = asked["example_scale"]
        if scale == "auto":
            if facts.dtype == torch.float32 and decided["tiled_mlp_shards"].on:
                return self.decision(asked, 1.0, "auto: an fp32 model with tiled MLPs", [0])
            return self.decision(asked, False, "auto: not an fp32 model with tiled MLPs")
        if scale is not False and not isinstance(scale, float):
            raise ValueError(f"example_scale must be 'auto', False or a float, got {scale!r}")
        return self.decision(asked, scale, "asked", [0] if scale else [])


class _ExampleFeature(DecoderFeature):
    """What a new feature is: its option, installed for the patch's lifetime, entered around the call after the
    feature it names, checked by its trace key."""

    name = "example"
    options = (_ExampleScale(),)
    after = ("recompute_norms",)

    def __init__(self):
        self.entered = 0

    def install(self, handle):
        scale = handle.state.value("example_scale")
        if scale:
            norm = handle.parts.decoder.norm
            handle.add_undo(install_forwards(
                [norm], lambda m, prev: _ScaledFinalNorm(m, prev, handle.state.trace, scale))[1])

    def active(self, call: DecoderCall) -> bool:
        return call.patch is not None and bool(call.patch.value("example_scale"))

    @contextlib.contextmanager
    def enter(self, call: DecoderCall):
        self.entered += 1
        with patch_trace_bound(call):
            yield

    def check(self, call: DecoderCall) -> None:
        if call.ran("example:final_norm") != 1:
            raise FastPathNotRunError(f"the example feature ran {call.ran('example:final_norm')} times, not once")


def test_a_new_feature_is_one_object_in_one_list(monkeypatch):
    """One object added to the one list: ``patch_model`` takes its option's keyword (a misspelt one is a
    ``TypeError`` naming it), resolves its ``"auto"`` rule from the facts and the other features' decisions into the
    plan (with why), refuses its declared conflict when both are asked for, installs it, and every call enters it
    (in its declared place) and checks that it ran."""
    feature = _ExampleFeature()
    features = entry_order((feature, *DECODER_FEATURES))  # listed first, entered after the feature it names
    assert features.index(feature) == [f.name for f in features].index("recompute_norms") + 1
    monkeypatch.setattr("actorcore.hf.decoder.DECODER_FEATURES", features)
    monkeypatch.setattr("actorcore.hf.patch.DECODER_FEATURES", features)
    model = build_tiny_model("llama", seed=1)
    batch = _batch()
    with torch.no_grad():
        want_lp, _ = reference_logprobs(build_tiny_model("llama", seed=1), *right_padded(_sequences()))
    with pytest.raises(TypeError, match="did you mean 'example_scale'"):
        ac.patch_model(model, example_scal=1.0)
    with pytest.raises(ValueError, match="example_scale must be"):
        ac.patch_model(model, example_scale="yes")
    with pytest.raises(ValueError, match=r"example_scale=2.0 and recompute_norms=True cannot both hold: both "
                                         r"replace the final norm's forward; pass example_scale=False"):
        ac.patch_model(model, example_scale=2.0, recompute_norms=True)
    handle = ac.patch_model(model, recompute_norms=True)  # "auto" yields: off, and says why
    assert handle.plan["example_scale"].value is False and "not an fp32 model with tiled MLPs" in str(handle.plan)
    handle.revert()
    handle = ac.patch_model(model, tiled_mlp_shards=2)  # "auto" from the facts and tiled MLP's decision: on
    assert handle.plan["example_scale"].value == 1.0 and "example_scale: 1.0 on 1 layers" in str(handle.plan)
    assert isinstance(model.model.norm.forward, _ScaledFinalNorm)
    trace = Counter()
    out = ac.compute_logprobs(model, batch, trace=trace)
    assert feature.entered == 1 and trace["example:final_norm"] == 1 and trace["tiled_mlp:forward"] == 2
    assert trace["plan:example"] == 1 and "example" in handle.calls[-1].ran
    assert (out.log_probs - want_lp).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    with torch.no_grad():
        model(input_ids=batch.input_ids[None])  # a plain forward: the patch's slot is unbound, nothing counts
    assert trace["example:final_norm"] == 1 and model.model.norm.forward.trace.counts is None
    del model.model.norm.__dict__["forward"]  # as if transformers bypassed it
    with pytest.raises(FastPathNotRunError, match="the example feature ran 0 times"):
        ac.compute_logprobs(model, batch)
    handle.revert()
    assert "forward" not in model.model.norm.__dict__
