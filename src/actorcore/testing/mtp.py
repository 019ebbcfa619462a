"""A tiny checkpoint with a multi-token-prediction layer named as in the DeepSeek-V3 / GLM-4.5 releases, and an
independent plain-torch MTP forward to check the Megatron route's MTP against (tests only)."""

from __future__ import annotations

import os

import torch


def _randomize_constants(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Norm weights (ones) and biases (zeros) get distinct values, so swapped mappings cannot pass."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
            state[name] = tensor + torch.randn(tensor.shape, generator=gen) * 0.1


def write_mtp_checkpoint(root: str, model_type: str = "deepseek_v3") -> tuple[str, str]:
    """(MTP checkpoint dir, donor dir) under ``root``. The donor is the tiny ``model_type`` with one more layer,
    whose last layer becomes the MTP layer's decoder layer; the MTP-only tensors are random, the embedding and
    head copies equal the main model's (as in the releases)."""
    from safetensors.torch import load_file, save_file

    from actorcore.testing.tiny_configs import build_tiny_model, tiny_config

    config = tiny_config(model_type, num_nextn_predict_layers=1)
    layers = config.num_hidden_layers
    donor = build_tiny_model(model_type, seed=5, num_hidden_layers=layers + 1)
    donor_dir, mtp_dir = os.path.join(root, "donor"), os.path.join(root, "mtp")
    donor.save_pretrained(donor_dir)
    state = load_file(os.path.join(donor_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    _randomize_constants(state, gen)
    save_file(state, os.path.join(donor_dir, "model.safetensors"), metadata={"format": "pt"})
    hidden = config.hidden_size
    mtp = f"model.layers.{layers}."
    state.update({
        mtp + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        mtp + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        mtp + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=gen),
        mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        mtp + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        mtp + "shared_head.head.weight": state["lm_head.weight"].clone(),
    })
    os.makedirs(mtp_dir)
    save_file(state, os.path.join(mtp_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(mtp_dir)
    return mtp_dir, donor_dir


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp(mtp_dir: str, donor_dir: str, sequences: list[torch.Tensor], scale: float):
    """Plain-torch DeepSeek-V3 / GLM-4.5 MTP forward, one sequence at a time (transformers' fp32 model for the main hidden
    states and the decoder layer): h' = eh_proj(cat(enorm(emb(t+1)), hnorm(h))) -> decoder layer ->
    shared_head.norm -> output layer; the log-prob of token t+2 at position t, aligned to the scored token.
    Returns (main log-probs ``[T]``, the MTP log-probs of each sequence, the MTP loss, the gradient of
    ``scale * loss`` in ``eh_proj``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from actorcore.testing.reference import reference_logprobs, right_padded

    main = AutoModelForCausalLM.from_pretrained(mtp_dir, attn_implementation="eager").eval()
    donor = AutoModelForCausalLM.from_pretrained(donor_dir, attn_implementation="eager").eval()
    layers, eps = main.config.num_hidden_layers, main.config.rms_norm_eps
    state = load_file(os.path.join(mtp_dir, "model.safetensors"))
    p = {k[len(f"model.layers.{layers}."):]: v for k, v in state.items() if k.startswith(f"model.layers.{layers}.")}
    eh_proj = p["eh_proj.weight"].clone().requires_grad_(True)
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
            x = torch.cat([_rms(emb, p["enorm.weight"], eps), _rms(h[:-1], p["hnorm.weight"], eps)], -1) @ eh_proj.T
            position = torch.arange(n - 1)[None]
            mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
            y = donor.model.layers[layers](x[None], attention_mask=mask, position_ids=position,
                                           position_embeddings=donor.model.rotary_emb(x[None], position))
            y = y[0] if isinstance(y, tuple) else y
            logits = _rms(y[0], p["shared_head.norm.weight"], eps) @ p["shared_head.head.weight"].T
            logp = torch.log_softmax(logits.float(), -1)[torch.arange(n - 2), ids[2:]]
            row[2:] = logp.detach()
            losses.append(-logp.sum())
            counts.append(n - 2)
        rows.append(row)
    loss = torch.stack(losses).sum() / sum(counts)
    (scale * loss).backward()
    return main_ref, rows, loss.detach(), eh_proj.grad
