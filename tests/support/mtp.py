"""Tiny checkpoints with a multi-token-prediction layer named as the releases name it, and an independent plain-torch
MTP forward to check the Megatron route's MTP against (tests only).

Two release layouts (``MTP_LAYOUTS``):

- ``extra_layer`` (DeepSeek-V3, GLM-4.5): MTP layer ``i`` is ``model.layers.{num_hidden_layers + i}.*``: ``enorm``,
  ``hnorm``, ``eh_proj``, ``shared_head.norm``, the decoder layer, and copies of the embedding (``embed_tokens``) and
  head (``shared_head.head``). h' = eh_proj(cat(enorm(emb(t+1)), hnorm(h))) -> decoder layer -> shared_head.norm.
- ``mtp_head`` (Qwen3-Next, Qwen3.5): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.layers.0.*`` (a full-attention decoder layer of the model's kind), ``mtp.norm``; the embedding and head are the
  main model's. As vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` run it:
  h' = fc(cat(pre_fc_norm_embedding(emb(t+1)), pre_fc_norm_hidden(h))) -> mtp.layers.0 -> norm, every norm
  zero-centred (scales by ``1 + w``).

``h`` is the main model's final-normed hidden state at position ``t``; the MTP output at ``t`` predicts token ``t + 2``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# How each architecture's releases store the MTP layer (every Megatron architecture with MTP rules has an entry).
MTP_LAYOUTS = {
    "deepseek_v3": "extra_layer",
    "glm4_moe": "extra_layer",
    "qwen3_next": "mtp_head",
    "qwen3_5_text": "mtp_head",
    "qwen3_5_moe_text": "mtp_head",
}
# The config fields the releases declare the MTP layers with. Qwen3-Next's release declares none (its one MTP layer is
# the default: vLLM reads num_nextn_predict_layers, 1 when absent; docs/megatron.md says where this was seen).
MTP_CONFIG_FIELDS = {
    "deepseek_v3": dict(num_nextn_predict_layers=1),
    "glm4_moe": dict(num_nextn_predict_layers=1),
    "qwen3_next": {},
    "qwen3_5_text": dict(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False),
    "qwen3_5_moe_text": dict(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False),
}
# Checkpoints written with the experts stacked per layer (``experts.gate_up_proj`` [E, 2I, D]), as the Qwen3.5-MoE
# releases store them; the others one tensor per expert.
GROUPED_EXPERT_CHECKPOINTS = ("qwen3_5_moe_text",)


def _randomize_constants(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Norm weights (ones, or zeros for zero-centred norms) and biases get distinct values, so swapped mappings cannot
    pass."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
            state[name] = tensor + torch.randn(tensor.shape, generator=gen) * 0.1


def mtp_tensor_names(model_type: str, names, num_hidden_layers: int) -> set[str]:
    """The names among ``names`` that belong to the MTP layer, as the releases store it."""
    prefix = f"model.layers.{num_hidden_layers}." if MTP_LAYOUTS[model_type] == "extra_layer" else "mtp."
    return {n for n in names if n.startswith(prefix)}


def _grouped_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``...experts.{e}.{gate,up,down}_proj.weight`` stacked per layer into ``experts.gate_up_proj`` [E, 2I, D] (gate
    rows, then up) and ``experts.down_proj`` [E, D, I], transformers 5's (and Qwen3.5-MoE's releases') layout."""
    import re

    per_expert = re.compile(r"^(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    out, parts = {}, {}
    for name, tensor in state.items():
        found = per_expert.match(name)
        if found is None:
            out[name] = tensor
        else:
            parts.setdefault(found.group(1), {})[(int(found.group(2)), found.group(3))] = tensor
    for prefix, tensors in parts.items():
        experts = sorted({e for e, _ in tensors})
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([tensors[(e, "gate")], tensors[(e, "up")]])
                                                    for e in experts])
        out[prefix + "down_proj"] = torch.stack([tensors[(e, "down")] for e in experts])
    return out


def write_mtp_checkpoint(root: str, model_type: str = "deepseek_v3", **overrides: Any) -> tuple[str, str]:
    """(MTP checkpoint dir, donor dir) under ``root``. The donor is the tiny ``model_type`` with one more layer (a
    full-attention one for the hybrids), whose last layer becomes the MTP layer's decoder layer; the MTP-only
    tensors are random (norm weights too), the embedding and head copies of the ``extra_layer`` layout equal the main
    model's (as in the releases). ``overrides``: config fields of both (``tie_word_embeddings=True``: no
    ``lm_head.weight`` is stored, as in the small Qwen3.5 releases)."""
    from safetensors.torch import load_file, save_file

    from actorcore.testing.tiny_configs import build_tiny_model, tiny_config

    layout = MTP_LAYOUTS[model_type]
    config = tiny_config(model_type, **MTP_CONFIG_FIELDS[model_type], **overrides)
    layers = config.num_hidden_layers
    extra = {}
    if getattr(config, "layer_types", None) is not None:
        extra["layer_types"] = [*config.layer_types, "full_attention"]
    donor = build_tiny_model(model_type, seed=5, num_hidden_layers=layers + 1, **extra, **overrides)
    donor_dir, mtp_dir = os.path.join(root, "donor"), os.path.join(root, "mtp")
    donor.save_pretrained(donor_dir)
    state = load_file(os.path.join(donor_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    _randomize_constants(state, gen)
    save_file(state, os.path.join(donor_dir, "model.safetensors"), metadata={"format": "pt"})
    hidden = config.hidden_size
    layer = f"model.layers.{layers}."
    if layout == "extra_layer":
        state.update({
            layer + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            layer + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            layer + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=gen),
            layer + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            layer + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
            layer + "shared_head.head.weight": state[_head_name(config)].clone(),
        })
    else:  # the decoder layer moves under mtp.layers.0; the zero-centred norms scatter around 0
        state = {("mtp.layers.0." + k[len(layer):] if k.startswith(layer) else k): v for k, v in state.items()}
        state.update({
            "mtp.fc.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=gen),
            "mtp.pre_fc_norm_embedding.weight": 0.2 * torch.randn(hidden, generator=gen),
            "mtp.pre_fc_norm_hidden.weight": 0.2 * torch.randn(hidden, generator=gen),
            "mtp.norm.weight": 0.2 * torch.randn(hidden, generator=gen),
        })
    if model_type in GROUPED_EXPERT_CHECKPOINTS:
        state = _grouped_experts(state)
    os.makedirs(mtp_dir)
    save_file(state, os.path.join(mtp_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(mtp_dir)
    return mtp_dir, donor_dir


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _head_name(config: Any) -> str:
    """The checkpoint tensor of the output head: the embedding when the config ties them (no lm_head is stored)."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def _mtp_parameters(layout: str, state: dict[str, torch.Tensor], layers: int, head: str) -> dict[str, torch.Tensor]:
    """The MTP-only tensors by role (``enorm``, ``hnorm``, ``proj``, ``norm``: the scales the norms apply; ``head``,
    the checkpoint's ``head`` tensor), from the checkpoint as the release names them."""
    if layout == "extra_layer":
        p = f"model.layers.{layers}."
        return dict(enorm=state[p + "enorm.weight"], hnorm=state[p + "hnorm.weight"], proj=state[p + "eh_proj.weight"],
                    norm=state[p + "shared_head.norm.weight"], head=state[p + "shared_head.head.weight"])
    return dict(enorm=1 + state["mtp.pre_fc_norm_embedding.weight"], hnorm=1 + state["mtp.pre_fc_norm_hidden.weight"],
                proj=state["mtp.fc.weight"], norm=1 + state["mtp.norm.weight"], head=state[head])


def reference_mtp(mtp_dir: str, donor_dir: str, sequences: list[torch.Tensor], scale: float):
    """Plain-torch MTP forward in the checkpoint's release layout (module docstring), one sequence at a time, with
    transformers' fp32 model for the main hidden states and the donor's last decoder layer as the MTP layer's; the
    log-prob of token t+2 at position t, aligned to the scored token.
    Returns (main log-probs ``[T]``, the MTP log-probs of each sequence, the MTP loss, the gradient of
    ``scale * loss`` in the projection, ``eh_proj`` / ``fc``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from actorcore.testing.reference import reference_logprobs, right_padded

    main = AutoModelForCausalLM.from_pretrained(mtp_dir, attn_implementation="eager").eval()
    donor = AutoModelForCausalLM.from_pretrained(donor_dir, attn_implementation="eager").eval()
    layers, eps = main.config.num_hidden_layers, main.config.rms_norm_eps
    p = _mtp_parameters(MTP_LAYOUTS[main.config.model_type], load_file(os.path.join(mtp_dir, "model.safetensors")),
                        layers, _head_name(main.config))
    proj = p["proj"].clone().requires_grad_(True)
    with torch.no_grad():
        main_ref = reference_logprobs(main, *right_padded(sequences))[0]
    rows, losses, counts = [], [], []
    for ids in sequences:
        n = len(ids)
        row = torch.zeros(n)
        if n >= 3:
            with torch.no_grad():
                h = main.model(input_ids=ids[None]).last_hidden_state[0]  # after the final norm
                emb = main.model.embed_tokens(ids[1:])
            x = torch.cat([_rms(emb, p["enorm"], eps), _rms(h[:-1], p["hnorm"], eps)], -1) @ proj.T
            position = torch.arange(n - 1)[None]
            mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
            y = donor.model.layers[layers](x[None], attention_mask=mask, position_ids=position,
                                           position_embeddings=donor.model.rotary_emb(x[None], position))
            y = y[0] if isinstance(y, tuple) else y
            logits = _rms(y[0], p["norm"], eps) @ p["head"].T
            logp = torch.log_softmax(logits.float(), -1)[torch.arange(n - 2), ids[2:]]
            row[2:] = logp.detach()
            losses.append(-logp.sum())
            counts.append(n - 2)
        rows.append(row)
    loss = torch.stack(losses).sum() / sum(counts)
    (scale * loss).backward()
    return main_ref, rows, loss.detach(), proj.grad
