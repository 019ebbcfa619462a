"""A hostile user of the public API: every wrong argument is refused with a ValueError naming the argument and
what to do (never an AttributeError / KeyError from deep inside, never silently accepted)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.testing.tiny_configs import build_tiny_model

MODEL = build_tiny_model("llama")
CRITIC = build_tiny_model("llama", task="token_classification")
BATCH = ac.pack([torch.tensor([3, 4, 5]), torch.tensor([6, 7])])
H = torch.randn(5, 8)
W = torch.randn(11, 8)
Y = torch.randint(0, 11, (5,))


def per_token(lp, ent, *args):
    return lp * args[0] if args else lp


def uses_entropy(lp, ent):
    return lp + ent


def logprob_entropy(**kw):
    args = dict(hidden_TD=H, weight_VD=W, labels_T=Y) | kw
    return ac.linear_logprob_entropy(args.pop("hidden_TD"), args.pop("weight_VD"), args.pop("labels_T"), **args)


def logprob_loss(loss_fn=per_token, **kw):
    return ac.linear_logprob_loss(H.clone().requires_grad_(), W, Y, loss_fn, **kw)


CASES = {
    # packing
    "pack: a tensor": (lambda: ac.pack(torch.tensor([1, 2])), "use pack_padded"),
    "pack: lists of ints": (lambda: ac.pack([[1, 2, 3]]), "sequence 0 must be a torch.Tensor"),
    "pack: float ids": (lambda: ac.pack([torch.tensor([1.0, 2.0])]), "integer token ids"),
    "pack: None": (lambda: ac.pack(None), "takes a list of 1-D id tensors"),
    "pack_padded: no mask": (lambda: ac.pack_padded(torch.ones(2, 3, dtype=torch.long), None), "attention_mask"),
    "pack_padded: mask shape": (lambda: ac.pack_padded(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4)),
                                "attention_mask shape"),
    "pack_padded: mask values": (lambda: ac.pack_padded(torch.ones(2, 3, dtype=torch.long), torch.full((2, 3), 2)),
                                 "only 0 and 1"),
    "unpack: not a batch": (lambda: ac.unpack(torch.zeros(5), "batch"), "unpack\\(\\) takes the PackedBatch"),
    "unpack: wrong length": (lambda: ac.unpack(torch.zeros(4), BATCH), "values have 4 tokens"),
    # compute_logprobs / compute_values / compute_loss
    "logprobs: temperature 0": (lambda: ac.compute_logprobs(MODEL, BATCH, temperature=0), "temperature must be"),
    "logprobs: temperature -1": (lambda: ac.compute_logprobs(MODEL, BATCH, temperature=-1), "temperature must be"),
    "logprobs: temperature nan": (lambda: ac.compute_logprobs(MODEL, BATCH, temperature=math.nan),
                                  "temperature must be a finite positive number"),
    "logprobs: temperature inf": (lambda: ac.compute_logprobs(MODEL, BATCH, temperature=math.inf),
                                  "temperature must be a finite positive number"),
    "logprobs: temperature True": (lambda: ac.compute_logprobs(MODEL, BATCH, temperature=True), "got True"),
    "logprobs: temperature str": (lambda: ac.compute_logprobs(MODEL, BATCH, temperature="1"), "temperature must"),
    "logprobs: entropy 'yes'": (lambda: ac.compute_logprobs(MODEL, BATCH, entropy="yes"), "entropy must be True or"),
    "logprobs: batch dict": (lambda: ac.compute_logprobs(MODEL, {"input_ids": BATCH.input_ids}),
                             "batch must be an actorcore.PackedBatch"),
    "logprobs: model str": (lambda: ac.compute_logprobs("llama", BATCH), "model must be a Hugging Face"),
    "logprobs: a critic": (lambda: ac.compute_logprobs(CRITIC, BATCH), "needs a ...ForCausalLM"),
    "logprobs: parallel str": (lambda: ac.compute_logprobs(MODEL, BATCH, parallel="sp"),
                               "parallel must be an actorcore.ParallelContext or None"),
    "logprobs: ids beyond the vocabulary": (lambda: ac.compute_logprobs(MODEL, ac.pack([torch.tensor([1, 500])])),
                                            "vocabulary has 131"),
    "logprobs: trace dict": (lambda: ac.compute_logprobs(MODEL, BATCH, trace={}), "trace must be a collections"),
    "values: a causal LM": (lambda: ac.compute_values(MODEL, BATCH), "needs a critic"),
    "values: parallel int": (lambda: ac.compute_values(CRITIC, BATCH, parallel=1), "parallel must be"),
    "values: trace list": (lambda: ac.compute_values(CRITIC, BATCH, trace=[]), "trace must be a collections"),
    "loss: loss_fn None": (lambda: ac.compute_loss(MODEL, BATCH, None), "loss_fn must be a callable"),
    "loss: bare tensor token_args": (lambda: ac.compute_loss(MODEL, BATCH, per_token, token_args=torch.zeros(5)),
                                     r"token_args=\(advantages,\)"),
    "loss: short token_args": (lambda: ac.compute_loss(MODEL, BATCH, per_token, token_args=(torch.zeros(4),)),
                               "one row per token"),
    "loss: temperature True": (lambda: ac.compute_loss(MODEL, BATCH, per_token, temperature=True), "temperature"),
    "loss: entropy 'yes'": (lambda: ac.compute_loss(MODEL, BATCH, per_token, entropy="yes"), "entropy must be"),
    "loss: uses entropy=None": (lambda: ac.compute_loss(MODEL, BATCH, uses_entropy, entropy=False),
                                "pass entropy=True if the loss uses them"),
    # kernels
    "entropy: labels of the wrong length": (lambda: logprob_entropy(labels_T=Y[:4]), "labels_T has 4 tokens"),
    "entropy: float labels": (lambda: logprob_entropy(labels_T=Y.float()), "labels_T must be int32 or int64"),
    "entropy: labels out of range": (lambda: logprob_entropy(labels_T=Y + 11), "mask ignored positions"),
    "entropy: hidden on another device": (lambda: logprob_entropy(hidden_TD=H.to("meta")), "one device"),
    "entropy: hidden a list": (lambda: logprob_entropy(hidden_TD=H.tolist()), "hidden_TD must be a 2-D"),
    "entropy: int hidden": (lambda: logprob_entropy(hidden_TD=H.long(), weight_VD=W.long()), "hidden_TD dtype"),
    "entropy: dtype mismatch": (lambda: logprob_entropy(weight_VD=W.double()), "same dtype"),
    "entropy: temperature 0": (lambda: logprob_entropy(temperature=0), "temperature must be"),
    "entropy: temperature True": (lambda: logprob_entropy(temperature=True), "got True"),
    "entropy: temperature nan": (lambda: logprob_entropy(temperature=math.nan), "got nan"),
    "entropy: entropy 'yes'": (lambda: logprob_entropy(entropy="yes"), "entropy must be True or False"),
    "entropy: chunk_size True": (lambda: logprob_entropy(chunk_size=True), "chunk_size must be"),
    "entropy: chunk_size 0": (lambda: logprob_entropy(chunk_size=0), "chunk_size must be"),
    "entropy: softcap nan": (lambda: logprob_entropy(softcap=math.nan), "softcap must be"),
    "entropy: unknown backend": (lambda: logprob_entropy(backend="cuda"), "unknown backend"),
    "entropy: trace list": (lambda: logprob_entropy(trace=[]), "trace must be a collections.Counter"),
    "loss kernel: token_args on another device": (
        lambda: logprob_loss(token_args=(torch.zeros(5, device="meta"),)), r"move it there with .to\('cpu'\)"),
    "loss kernel: token_args None": (lambda: logprob_loss(token_args=None), "token_args must be a tuple"),
    "loss kernel: uses entropy=None": (lambda: logprob_loss(uses_entropy, entropy=False), "pass entropy=True"),
    "loss kernel: trace dict": (lambda: logprob_loss(trace={}), "trace must be"),
    # patch_model, ParallelContext, verify, register_arch
    "patch: tiled_mlp_shards 0": (lambda: ac.patch_model(build_tiny_model("llama"), tiled_mlp_shards=0),
                                  "tiled_mlp_shards must be a positive int"),
    "patch: tiled_mlp_shards True": (lambda: ac.patch_model(build_tiny_model("llama"), tiled_mlp_shards=True),
                                     "tiled_mlp_shards must be a positive int"),
    "patch: parallel str": (lambda: ac.patch_model(build_tiny_model("llama"), parallel="sp"), "parallel must be"),
    "patch: model str": (lambda: ac.patch_model("model"), "model must be a Hugging Face"),
    "patch: a plain module": (lambda: ac.patch_model(torch.nn.Linear(2, 2)), "model must be a Hugging Face"),
    "context: group without torch.distributed": (lambda: ac.ParallelContext(sp_group="g"), "not initialized"),
    "verify: batch str": (lambda: ac.verify(MODEL, "batch"), "batch must be an actorcore.PackedBatch"),
    "verify: model str": (lambda: ac.verify("model", BATCH), "model must be a Hugging Face"),
    "verify: temperature 0": (lambda: ac.verify(MODEL, BATCH, temperature=0), "temperature must be"),
    "verify: tolerance -1": (lambda: ac.verify(MODEL, BATCH, tolerance=-1), "tolerance must be None"),
    "verify: tolerance str": (lambda: ac.verify(MODEL, BATCH, tolerance="x"), "tolerance must be None"),
    "register_arch: a name, not a spec": (lambda: ac.register_arch("llama", MODEL.config), "takes an actorcore"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_argument_is_a_clear_value_error(case):
    call, fragment = CASES[case]
    with pytest.raises(ValueError, match=fragment):
        call()


def test_a_counter_trace_and_a_numpy_float_temperature_work():
    np = pytest.importorskip("numpy")
    trace = Counter()
    out = ac.compute_logprobs(MODEL, BATCH, temperature=np.float64(0.7), trace=trace)
    assert out.log_probs.shape == (5,) and trace["attention:actorcore_packed"] == 2
