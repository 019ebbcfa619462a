"""Errors a hostile but fair user meets on the newer surfaces say what was wrong and what to do: a base model
without its LM head, a batch or a model on the meta device, a layer count edited after the model was built, a
receiver that is not a model."""

import pytest
import torch

import actorcore as ac
from actorcore.errors import UnsupportedArchitectureError
from actorcore.export import hf_weight_stream, load_into
from actorcore.testing.tiny_configs import build_tiny_model


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama", seed=0)


def _batch():
    return ac.pack([torch.arange(5), torch.arange(7)])


def test_a_base_model_is_told_to_use_the_causal_lm(model):
    with pytest.raises(UnsupportedArchitectureError, match=r"LlamaModel is a base model.*ForCausalLM"):
        ac.compute_logprobs(model.model, _batch())


def test_meta_device_batches_and_models_are_named():
    with pytest.raises(ValueError, match=r"input_ids is on the meta device.*ac.pack"):
        _batch().to("meta")
    with torch.device("meta"):
        empty = build_tiny_model("llama")
    with pytest.raises(ValueError, match=r"weights are on the meta device.*load them"):
        ac.compute_logprobs(empty, _batch())


def test_a_layer_count_edited_after_building_is_named_not_blamed_on_transformers():
    edited = build_tiny_model("llama", seed=0)
    edited.config.num_hidden_layers = 1
    with pytest.raises(ValueError, match=r"has 2 decoder layers but its config says num_hidden_layers=1"):
        ac.compute_logprobs(edited, _batch())


def test_load_into_something_that_is_not_a_model(model):
    with pytest.raises(ValueError, match=r"load_into needs the receiving torch model.*load_into_vllm"):
        load_into(object(), hf_weight_stream(model, names="model"))
