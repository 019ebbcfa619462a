"""Which fusion of the decoder's elementwise work is fastest, measured on the whole actor step.

One ``ac.compute_loss`` forward+backward of a Qwen2.5-1.5B-shaped model (bf16, random weights) on one pack of the
RL batch (about 31K tokens), per variant: eager with full layer checkpointing (the baseline), eager with
selective checkpointing (matmul and attention outputs kept, the rest recomputed), eager without checkpointing,
Liger-Kernel's RMSNorm + SwiGLU as per-instance forwards, regional ``torch.compile`` of each decoder layer's
forward (``dynamic=True``; the attention call left eager), with full / no checkpointing. Per variant: time,
peak memory, max |Δ log-prob| and max |Δ grad| of two weights against the baseline, first-call seconds and the
number of graphs compiled (a second pack of another length must add none), and the kernel-time breakdown.
Then the MoE shape (Qwen3-30B-A3B, 8 layers) baseline breakdown, for where its time goes.

    PYTHONPATH=src:/tmp/site python3 bench/fusion_candidates.py [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_route import QWEN25_15B, TINY, model_and_sequences  # noqa: E402
from step_profile import kernel_breakdown, mfu, pack_greedy, print_rows, timed, write_json  # noqa: E402

QWEN3_MOE_30B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=32768,
                     tie_word_embeddings=False, rope_theta=1e6)
TINY_MOE = dict(TINY, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2, head_dim=16)


def _neg_logprob(logprob, entropy, adv):
    return -(logprob * adv)


def _layers(model):
    return list(model.model.layers)


def sac_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):
        name = str(op)
        if op in keep or "varlen_attn" in name or "flash_attention" in name or "grouped_mm" in name:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def set_checkpointing(model, mode: str):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "none":
        model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "selective":
        policy = sac_policy()
        fn = functools.partial(checkpoint, use_reentrant=False,
                               context_fn=lambda: create_selective_checkpoint_contexts(policy))
        for layer in _layers(model):
            layer._gradient_checkpointing_func = fn


def install_liger(model):
    from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu

    undo = []
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            def norm_forward(x, m=module):
                return liger_rms_norm(x, m.weight, m.variance_epsilon, 0.0, "llama", False)
            module.forward = norm_forward
            undo.append(module)
        if type(module).__name__.endswith("MLP") and hasattr(module, "gate_proj"):
            def mlp_forward(x, m=module):
                return m.down_proj(liger_swiglu(m.gate_proj(x), m.up_proj(x)))
            module.forward = mlp_forward
            undo.append(module)
    return lambda: [m.__dict__.pop("forward", None) for m in undo]


def install_compile(model, dynamic):
    layers = _layers(model)
    for layer in layers:
        layer.forward = torch.compile(type(layer).forward.__get__(layer), dynamic=dynamic)
    return lambda: [layer.__dict__.pop("forward", None) for layer in layers]


def disable_attention_compile():
    from transformers import AttentionInterface

    from actorcore.hf.features.attention import packed_attention_forward, register_attention

    name = register_attention()
    AttentionInterface.register(name, torch.compiler.disable(packed_attention_forward))


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_dense(args, device, out_rows):
    import actorcore as ac

    shape = TINY if args.tiny else QWEN25_15B
    model, sequences, _ = model_and_sequences("qwen2", shape, device, 32, 256, 6144)
    packs = pack_greedy(sequences, 32768 if not args.tiny else 4000)
    batch = ac.pack(packs[0]).to(device)
    other = ac.pack(packs[1]).to(device)
    params = sum(p.numel() for p in model.parameters())
    weights = [model.model.layers[0].self_attn.q_proj.weight, model.model.layers[-1].mlp.down_proj.weight]
    adv = torch.randn(batch.num_real_tokens, generator=torch.Generator().manual_seed(3)).to(device)
    adv_other = torch.randn(other.num_real_tokens, generator=torch.Generator().manual_seed(4)).to(device)
    model.train()

    def step(b=batch, a=adv):
        model.zero_grad(set_to_none=True)
        out = ac.compute_loss(model, b, _neg_logprob, (a,), entropy=True)
        out.loss.backward()
        return out

    reference = {}
    disable_attention_compile()
    variants = [("eager ckpt", "full", None), ("eager selective", "selective", None), ("eager no ckpt", "none", None),
                ("liger ckpt", "full", "liger"), ("compile ckpt", "full", "compile"),
                ("compile no ckpt", "none", "compile"), ("compile selective", "selective", "compile")]
    for name, ckpt, fusion in variants:
        if time.perf_counter() - args.start > args.budget_s:
            print(f"[skip] {name}: time budget", flush=True)
            continue
        set_checkpointing(model, ckpt)
        undo = (install_liger(model) if fusion == "liger" else install_compile(model, True) if fusion == "compile"
                else (lambda: None))
        row = {"variant": name}
        try:
            graphs = graphs_compiled()
            start = time.perf_counter()
            out = step()
            torch.cuda.synchronize() if device == "cuda" else None
            row["first_call_s"] = time.perf_counter() - start
            grads = [w.grad.detach().float().clone() for w in weights]
            lp = out.logprob.detach().float()
            if not reference:
                reference.update(lp=lp, grads=grads)
            row["max_dlp"] = (lp - reference["lp"]).abs().max().item()
            row["max_dgrad_rel"] = max(((g - r).abs().max() / r.abs().max()).item()
                                       for g, r in zip(grads, reference["grads"]))
            row.update(timed(step, repeats=args.repeats, warmup=1))
            row["graphs"] = graphs_compiled() - graphs
            step(other, adv_other)
            row["graphs_after_other_pack"] = graphs_compiled() - graphs
            row["tokens_per_s"] = batch.num_tokens / row["seconds"]
            row["mfu"] = mfu(params, batch.num_tokens, row["seconds"])
            if args.profile:
                row["breakdown"], row["top"] = kernel_breakdown(step)
        except Exception as error:  # a candidate that does not run is a result, not the end of the probe
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        finally:
            undo()
        out_rows.append(row)
        print(f"[row] {json.dumps({k: v for k, v in row.items() if k != 'top'})}", flush=True)
    set_checkpointing(model, "full")
    return batch.num_tokens, params


def run_moe(args, device, out_rows):
    import actorcore as ac
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = TINY_MOE if args.tiny else QWEN3_MOE_30B
    config = AutoConfig.for_model("qwen3_moe", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(256, 2048, (12,), generator=g).tolist()
    batch = ac.pack([torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]).to(device)
    adv = torch.randn(batch.num_real_tokens, generator=g).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        ac.compute_loss(model, batch, _neg_logprob, (adv,)).loss.backward()

    row = {"variant": "moe eager ckpt", "tokens": batch.num_tokens}
    row.update(timed(step, repeats=args.repeats))
    row["tokens_per_s"] = batch.num_tokens / row["seconds"]
    if args.profile:
        row["breakdown"], row["top"] = kernel_breakdown(step)
    out_rows.append(row)
    print(f"[row] {json.dumps({k: v for k, v in row.items() if k != 'top'})}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=230.0, help="skip variants that would start after this")
    parser.add_argument("--no-moe", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    args.profile = device == "cuda"
    rows: list = []
    tokens, params = run_dense(args, device, rows)
    if not args.no_moe:
        try:
            run_moe(args, device, rows)
        except Exception as error:
            rows.append({"variant": "moe", "error": f"{type(error).__name__}: {str(error)[:300]}"})
    write_json(args.out, "fusion_candidates.json", rows)
    print(f"dense: {tokens} tokens, {params / 1e9:.2f}B parameters")
    print_rows(rows, "variant", lambda row: (
        f"{row['seconds'] * 1e3:8.1f}ms {row['tokens_per_s']:9.0f} tok/s mfu {row.get('mfu', 0):.3f} "
        f"peak {row['peak_gib']:6.1f}GiB graphs {row.get('graphs', '-')}/{row.get('graphs_after_other_pack', '-')} "
        f"dlp {row.get('max_dlp', 0):.2e} dgrad {row.get('max_dgrad_rel', 0):.2e}"))
    for row in rows:
        for name, ms in row.get("top", [])[:8]:
            print(f"  [{row['variant']}] {ms:8.1f}ms {name}")


if __name__ == "__main__":
    main()
