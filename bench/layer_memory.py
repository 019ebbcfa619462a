"""What one decoder layer keeps after its forward, bytes per token: the HF route (compiled decoder, quack's experts,
no checkpointing) against the Megatron route (compiled layers, local quack experts, no recompute), the
Qwen3-30B-A3B shape with 2 layers, one 32K-token pack; for the Megatron layer also by module (forward hooks: the
memory allocated after the module's forward minus before, its output included), and the HF layer module by module
with its decoder eager (inside the compiled graph its modules are not called one by one).

    python bench/layer_memory.py                 # on a GPU; writes layer_memory.json to $OUT (or here)
    MODEL=tiny-moe python bench/layer_memory.py  # on the CPU: checks that the script runs (every byte reads 0)
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import actor_step  # noqa: E402

import actorcore as ac  # noqa: E402

HF_MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "mlp.gate")
MEGATRON_MODULES = ("input_layernorm", "self_attention", "self_attention.linear_qkv", "self_attention.core_attention",
                    "self_attention.linear_proj", "pre_mlp_layernorm", "mlp", "mlp.router")


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


class LayerBytes:
    """Forward hooks on each layer (and the named modules inside it) recording the memory allocated around them."""

    def __init__(self, layers: list, modules: tuple[str, ...] = ()) -> None:
        self.log: dict[tuple, int] = {}
        self.handles = []
        for i, layer in enumerate(layers):
            for name in ("layer", *modules):
                module = layer if name == "layer" else layer.get_submodule(name)
                self.handles.append(module.register_forward_pre_hook(self._at(i, name, "before")))
                self.handles.append(module.register_forward_hook(self._at(i, name, "after")))

    def _at(self, index: int, name: str, when: str):
        def hook(*_):
            self.log[(index, name, when)] = allocated()
        return hook

    def per_token(self, tokens: int) -> dict[str, int]:
        return {f"{i}.{name}": round((v - self.log[(i, name, "before")]) / tokens)
                for (i, name, when), v in self.log.items() if when == "after"}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, pack, pack_advantages = actor_step.one_pack_model(os.environ.get("MODEL", "qwen3-30b-a3b"), device, 2)
    tokens = sum(s.numel() for s in pack)
    out = {"tokens": tokens}

    batch, adv = ac.pack(pack).to(device), torch.cat(pack_advantages).to(device)
    # compiled (the default; the layer whole) and eager (module by module: the compiled graph hides its modules)
    for key, compiled, modules in (("hf", "auto", ()), ("hf_eager", False, HF_MODULES)):
        handle = ac.patch_model(model, compiled_decoder=compiled, checkpointing=None,
                                moe_experts="quack" if cuda else False, swiglu_mlp=False)
        hf = LayerBytes(list(model.model.layers), modules)
        resident = allocated() / 2**30  # weights and anything left behind
        for _ in range(2):  # the second call, compiled
            ac.compute_loss(model, batch, lambda lp, ent, a: -(lp * a), (adv,), entropy=False).loss.backward()
            model.zero_grad(set_to_none=True)
        out[key] = {"layers": hf.per_token(tokens), "peak_gib": peak_gib(), "resident_gib": resident}
        hf.remove()
        handle.revert()

    options = dict(moe_experts="quack" if cuda else "grouped", compiled_layers=cuda, swiglu_mlp="auto", recompute=None)
    step, chunks = actor_step.megatron_step(model, [pack], [pack_advantages], device, options, fused_loss=True)
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    megatron = LayerBytes(layers, MEGATRON_MODULES)
    resident = allocated() / 2**30
    for _ in range(2):
        chunks.zero_grad()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step()
    out["megatron"] = {"layers": megatron.per_token(tokens), "peak_gib": peak_gib(), "resident_gib": resident}
    print(json.dumps(out), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "layer_memory.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
