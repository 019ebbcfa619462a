"""The actor step side by side: actorcore (before: eager decoder + full checkpointing + transformers' experts; after:
compiled decoder + budgeted checkpointing + on MoE models actorcore's experts path, and the same with transformers'
experts) against plain transformers (padded micro-batches; its own packing), transformers with Liger-Kernel's
patches and actorcore's own Megatron-Core route (``megatron``), on one GPU, in one run.

The step: forward+backward of a token-wise policy loss (-log p x advantage) over the RL batch (32 sequences of
256-6144 tokens, seed 1: 91,213 tokens), actorcore in packs of at most 32K tokens (``ac.compute_loss``),
transformers in padded micro-batches (its logits, log-softmax in fp32). Per path: tokens/s, MFU (6 x active
parameters x tokens / 790 TFLOP/s), peak memory, max |Δ log-prob| against the eager fp32 model (the same
weights), and the kernel-time breakdown by category (``step_profile``). Random weights of a real shape.

    PYTHONPATH=src:/tmp/site python3 bench/actor_step.py --model qwen2.5-1.5b [--layers N] [--paths a,b]
        [--budget-gib 40] [--out DIR] [--mcore-experts auto|grouped|quack|sequential] [--mcore-fused auto|on|off]
        [--mcore-swiglu auto|quack|off] [--mcore-recompute auto|selective|full|none]

A path name with " fa4" appended runs that path with FlashAttention-4 (see ``FA4_SUFFIX``). "actorcore fused quack-mlp
offload" moves checkpointed inputs to the host (``offload_activations``): ``--offload-layers auto`` (default) those of
the layers the budget's plan fully checkpoints, K those of the first K layers.

Under ``torchrun --nproc-per-node N`` (NCCL on N GPUs; gloo on the CPU with ``--model tiny``) the actorcore paths run
with FSDP2 (``fully_shard`` per decoder layer and the root), each rank on its share of the sequences (every N-th,
packed on its own): tokens/s over all ranks and the scaling efficiency against the one-GPU row of the same path
given by ``--single-json`` (a JSON written by a one-process run).

    PYTHONPATH=src torchrun --nproc-per-node 2 bench/actor_step.py --model qwen2.5-1.5b \
        --paths "actorcore before,actorcore fused" --single-json $OUT/actor_step_qwen2.5-1.5b.json --out $OUT/fsdp2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_route import QWEN25_15B, TINY  # noqa: E402
from step_profile import (format_breakdown, kernel_breakdown, kernel_sources, mfu, pack_greedy, print_rows, sync,  # noqa: E402
                          write_json)

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                tie_word_embeddings=False, rope_theta=1e6)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                     tie_word_embeddings=False, rope_theta=1e6)
TINY_MOE = dict(TINY, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                tie_word_embeddings=False)
MODELS = {"qwen2.5-1.5b": ("qwen2", QWEN25_15B), "qwen3-8b": ("qwen3", QWEN3_8B),
          "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B), "tiny": ("qwen2", TINY), "tiny-moe": ("qwen3_moe", TINY_MOE)}
PATHS = ("actorcore before", "actorcore fused", "actorcore fused transformers-experts", "actorcore fused no-ckpt",
         "actorcore fused quack-experts", "actorcore fused quack-experts no-ckpt",
         "actorcore fused quack-mlp", "actorcore fused quack-mlp no-gate-up", "actorcore fused quack-mlp no-ckpt",
         "actorcore fused quack-mlp offload", "actorcore fused quack-mlp offload ckpt-around",
         "transformers padded", "transformers packed", "transformers+liger padded", "megatron before", "megatron")
# On MoE models "actorcore fused" and "actorcore fused no-ckpt" run actorcore's gather-only experts path
# (``moe_experts="grouped"``, the default under the compiled decoder), "actorcore fused transformers-experts" transformers'
# own grouped_mm forward, "... quack-experts" that path with quack's fused GEMMs (``moe_experts="quack"``).
# The dense SwiGLU MLPs stay compiled (``swiglu_mlp=False``) except on the "... quack-mlp" paths (``swiglu_mlp="quack"``).
# "... no-gate-up": the budget planner as it was before its "gate_up" mode (layers kept whole or fully checkpointed,
# none kept but for their quack MLP's gate/up output): the same plan's before and after in one process.
# "... ckpt-around": the fully checkpointed compiled layers under torch's checkpoint around the compiled forward (its
# recompute redoes the whole forward) instead of inside their compiled graph, with the same plan.
# "megatron": actorcore's Megatron-Core route on this one GPU (``megatron_step``) with its speed options as
# ``--mcore-experts`` / ``--mcore-fused`` / ``--mcore-recompute`` set them (by default the route's defaults, and
# recompute "auto" at ``--budget-gib``, the HF paths' budget) and the loss fused into the head
# (``actorcore.mcore.compute_loss``, the same token loss as the HF paths); "megatron before": megatron-core's
# sequential experts, unfused layers, no recompute, the loss through ``compute_logprobs(loss_fn=...)`` (the route
# before these options). They run last (they move the HF model off the GPU).
# Any actorcore or megatron path with " fa4" appended ("actorcore fused fa4", "megatron fa4") runs the same with its
# attention on FlashAttention-4 (``patch_model(attention_backend="fa4")``, ``mcore.build.attention.use_attention_backend``),
# right after the path without it: before and after in one process. The paths without it keep "auto".
FA4_SUFFIX = " fa4"


def ordered_paths(wanted: list[str]) -> list[str]:
    """The asked-for paths in run order (``PATHS``, each followed by its FA4 variant); unknown names refused."""
    known = [variant for base in PATHS for variant in (base, base + FA4_SUFFIX)
             if not variant.endswith(FA4_SUFFIX) or base.startswith(("actorcore", "megatron"))]
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise SystemExit(f"unknown paths {unknown}; choose from {known}")
    return [p for p in known if p in wanted]


@contextlib.contextmanager
def whole_layers_only():
    """The "auto" planner offered no "gate_up" layers (it sees no quack MLP to run that way) while a path runs."""
    import actorcore.hf.features.checkpointing as checkpointing

    offered = checkpointing.quack_mlps
    checkpointing.quack_mlps = lambda layer: []
    try:
        yield
    finally:
        checkpointing.quack_mlps = offered


@contextlib.contextmanager
def checkpointed_around(model):
    """The fully checkpointed compiled layers under torch's checkpoint around their compiled forward (as before the
    checkpoint went inside the compiled graph: the recompute redoes the whole forward) while a path runs; the plan
    stays the same."""
    import actorcore.hf.features.compiled_decoder as compiled_decoder

    variant = compiled_decoder.compiled_forward(compiled_decoder.original_forward(type(model.model.layers[0])),
                                                checkpointed=True)
    refusal, variant.refusal = variant.refusal, "the bench's ckpt-around path"
    try:
        yield
    finally:
        variant.refusal = refusal


def build(model_type, shape, dtype, device, layers):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **dict(shape, **({"num_hidden_layers": layers} if layers else {})))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model


def active_parameters(model) -> float:
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    if getattr(cfg, "num_experts", None):
        expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        total -= expert * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    return float(total)


def batch_sequences(vocab, tiny):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(256, (600 if tiny else 6144) + 1, (32,), generator=g).tolist()
    sequences = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    advantages = [torch.randn(n, generator=g) for n in lengths]
    return sequences, advantages


def one_pack_model(model_name: str, device: str, layers: int):
    """The bench batch's first 32K-token pack and a ``layers``-layer model of ``model_name``'s shape (bf16 on CUDA,
    fp32 elsewhere; the tiny batch off CUDA), for the per-pack memory scripts: (model, sequences, advantages)."""
    model_type, shape = MODELS[model_name]
    cuda = device == "cuda"
    sequences, advantages = batch_sequences(shape["vocab_size"], not cuda)
    first = pack_greedy([torch.arange(s.numel()) for s in sequences], 32768)[0]
    model = build(model_type, shape, torch.bfloat16 if cuda else torch.float32, device, layers).train()
    return model, sequences[:len(first)], advantages[:len(first)]


def per_token_reference(model, packs, device):
    """Eager fp32 log-probs per pack (actorcore's exact packed path, unfused: the fp32 model is not patched)."""
    import actorcore as ac

    with torch.no_grad():
        return [ac.compute_logprobs(model, ac.pack(p).to(device), entropy=False).log_probs.cpu() for p in packs]


def actorcore_step(model, packs, advs, device):
    import actorcore as ac

    batches = [ac.pack(p).to(device) for p in packs]
    args = [torch.cat(pa).to(device) for pa in advs]  # the scored-token layout: row t scores token t

    trace = Counter()
    packs_seen = []  # per call, per pack: its own peak (GiB) and its layers' checkpoint modes

    def step():
        out = []
        trace.clear()
        packs_seen.append([])
        for b, a in zip(batches, args):
            before = Counter(trace)
            peak = PackPeak()
            res = ac.compute_loss(model, b, lambda lp, ent, adv: -(lp * adv), (a,), entropy=False, trace=trace)
            res.loss.backward()
            out.append(res.logprob.detach().float())
            modes = {PACK_KEYS[k]: trace[k] - before[k] for k in PACK_KEYS if trace[k] - before[k]}
            packs_seen[-1].append((b.num_tokens, peak.read(), modes))
        return [lp.cpu() for lp in out]  # after the last pack: no host sync between packs
    step.trace = trace  # the last step's kernels, compiled layers and checkpointing modes
    step.packs_seen = packs_seen
    return step


# What each pack's plan ran: layers per checkpointing mode, and the layers whose input activation offload moved.
PACK_KEYS = {"checkpoint:full_layers": "full_layers", "checkpoint:compiled_layers_kept": "compiled_layers_kept",
             "checkpoint:gate_up_layers": "gate_up_layers", "checkpoint:selective_layers": "selective_layers",
             "offload:layers": "offloaded_layers"}


class PackPeak:
    """One pack's own peak (GiB): the process's peak counter restarted for the pack (the path's row then takes the
    largest pack peak of all its calls as its peak). None off CUDA."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2**30, 3) if self.cuda else None


def transformers_step(model, sequences, advs, device, micro, packed):
    """Plain transformers: padded micro-batches (right padding), or its own packing from position ids (one row per
    pack, ``use_cache=False``)."""

    def padded_call(seqs, ads):
        width = max(s.numel() for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        adv = torch.zeros(len(seqs), width)
        for i, (s, a) in enumerate(zip(seqs, ads)):
            ids[i, : s.numel()], mask[i, : s.numel()], adv[i, : s.numel()] = s, 1, a
        ids, mask, adv = ids.to(device), mask.to(device), adv.to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
        (-(logp * adv[:, 1:])).sum().backward()
        return [logp[i, : s.numel() - 1].detach() for i, s in enumerate(seqs)]

    def packed_call(seqs, ads):
        ids = torch.cat(seqs).to(device)[None]
        pos = torch.cat([torch.arange(s.numel()) for s in seqs]).to(device)[None]
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        logp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        adv = torch.cat(ads).to(device)[1:]
        keep = (pos[0, 1:] != 0).float()
        (-(logp * adv * keep)).sum().backward()
        bounds, out, start = [s.numel() for s in seqs], [], 0
        for n in bounds:
            out.append(logp[start: start + n - 1].detach())
            start += n
        return out

    groups = packed if packed else [list(range(i, min(i + micro, len(sequences)))) for i in range(0, len(sequences), micro)]

    def step():
        out = []
        for g in groups:
            out.extend((packed_call if packed else padded_call)([sequences[i] for i in g], [advs[i] for i in g]))
        return [lp.cpu() for lp in out]
    return step


class MegatronChunks(torch.nn.ModuleList):
    """The Megatron model's chunks as one module for ``run_path`` (its ``zero_grad`` clears ``main_grad`` too)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad = None


def megatron_options(name: str, args) -> dict:
    """``build_gpt_model``'s speed options for a Megatron path: "megatron before" turns each off; "megatron" takes
    the flags (``--mcore-*``), recompute "auto" at the HF paths' budget by default."""
    if name == "megatron before":
        return dict(moe_experts="sequential", compiled_layers=False, swiglu_mlp=False, recompute=None)
    fused = {"auto": "auto", "on": True, "off": False}[args.mcore_fused]
    recompute = None if args.mcore_recompute == "none" else args.mcore_recompute
    swiglu = {"auto": "auto", "quack": "quack", "off": False}[args.mcore_swiglu]
    return dict(moe_experts=args.mcore_experts, compiled_layers=fused, swiglu_mlp=swiglu, recompute=recompute,
                memory_budget_gib=args.budget_gib if recompute == "auto" else None)


def megatron_step(model, packs, advs, device, options: dict, fused_loss: bool):
    """actorcore's Megatron-Core route on this one device (TP = PP = EP = CP = 1), with the same weights: the HF
    model written to a scratch checkpoint and loaded by ``load_hf_into_mcore`` (the HF model then leaves the GPU),
    the packs forward+backward with the same token loss (Megatron's schedule averages the loss over the packs: the
    gradients' scale differs, not the work): ``fused_loss`` through ``actorcore.mcore.compute_loss`` (the loss in the
    head, as the HF paths' ``ac.compute_loss``), else through ``compute_logprobs(loss_fn=...)`` (the head recomputes
    the logits in backward). ``options``: ``build_gpt_model``'s speed options. Returns the step (its ``trace`` and
    ``choices``: what the call ran and what the model resolved) and the chunks (for ``run_path``)."""
    import tempfile

    import torch.distributed as dist

    import actorcore as ac
    from actorcore.mcore import McoreParallel, build_gpt_model, initialize_megatron, load_hf_into_mcore
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore import compute_logprobs, compute_loss

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    runtime = CpuRuntime()  # megatron-core's CPU shims (no-op with CUDA)
    with tempfile.TemporaryDirectory() as scratch, runtime:
        model.save_pretrained(scratch)
        model.to("cpu")
        initialize_megatron(McoreParallel())
        mcore_model = build_gpt_model(model.config, McoreParallel(), **options)
        load_hf_into_mcore(mcore_model, scratch)
    chunks = MegatronChunks(mcore_model.chunks).train()
    batches = [ac.pack(p).to(device) for p in packs]
    args = [torch.cat(pa).to(device) for pa in advs]
    trace = Counter()

    def step():
        order = iter(args)  # the schedule runs the packs in order, one loss call each
        trace.clear()

        def loss(out, batch):
            adv = next(order)
            return -(out.log_probs[: adv.numel()] * adv).sum()

        with runtime:
            if fused_loss:
                outs = compute_loss(mcore_model, batches, lambda lp, ent, adv: -(lp * adv), [(a,) for a in args],
                                    entropy=False, trace=trace)
                return [o.logprob[: b.num_tokens].float().cpu() for o, b in zip(outs, batches)]
            outs = compute_logprobs(mcore_model, batches, entropy=False, loss_fn=loss, trace=trace)
        return [o.log_probs[: b.num_tokens].float().cpu() for o, b in zip(outs, batches)]
    step.trace = trace
    step.choices = {"moe_experts": mcore_model.moe_experts, "compiled_layers": mcore_model.compiled_layers,
                    "swiglu_mlp": mcore_model.swiglu_mlp,
                    "recompute": None if mcore_model.recompute is None else mcore_model.recompute.mode}
    return step, chunks


def counted_attention(step, modules):
    """``step`` with the Megatron core attentions counting the kernels they ran in ``step.trace`` (its last call,
    which the step clears)."""
    trace = step.trace

    def counted():
        for module in modules:
            module.trace = trace
        try:
            return step()
        finally:
            for module in modules:
                module.trace = None
    counted.trace = trace
    counted.choices = step.choices
    return counted


def world() -> tuple[int, int]:
    """(rank, world size) of a torchrun launch; (0, 1) otherwise."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def init_fsdp(device_type: str) -> str:
    """Join the torchrun group (NCCL on CUDA, gloo on the CPU); the rank's device."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return f"cuda:{local}"
    dist.init_process_group("gloo")
    return "cpu"


def shard_fsdp2(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def all_ranks_tokens(tokens: int) -> int:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:  # the megatron path's own one-rank group
        return tokens
    total = torch.tensor([tokens], dtype=torch.float64)
    dist.all_reduce(total)
    return int(total.item())


def global_row(row: dict, total_tokens: int) -> dict:
    """Across the ranks: the slowest rank's seconds, all ranks' tokens, the largest peak."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or "error" in row:
        return row
    seconds, peak = torch.tensor([row["seconds"]], dtype=torch.float64), torch.tensor([row["peak_gib"]])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row.update(seconds=seconds.item(), peak_gib=peak.item(), tokens_per_s=total_tokens / seconds.item(),
               tokens=total_tokens, ranks=dist.get_world_size())
    return row


def run_path(name, model, step, tokens, active, profile, repeats, first_timeout, warmup=0):
    row = {"path": name}
    cuda = torch.cuda.is_available()
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        row["resident_gib"] = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0  # weights and leftovers
        lp = step()
        sync()
        row["first_call_s"] = time.perf_counter() - start
        times = []
        fast_enough = row["first_call_s"] < first_timeout
        for _ in range(warmup if fast_enough else 0):  # untimed: plans from measured bytes meet their variants here
            model.zero_grad(set_to_none=True)
            step()
            sync()
        for _ in range(repeats if fast_enough else 0):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            lp = step()
            sync()
            times.append(time.perf_counter() - start)
        row["seconds"] = sorted(times)[len(times) // 2] if times else row["first_call_s"]
        row["times"] = [round(t, 4) for t in times]
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        row["tokens_per_s"] = tokens / row["seconds"]
        row["mfu"] = mfu(active, tokens, row["seconds"])
        if profile:
            model.zero_grad(set_to_none=True)
            row["breakdown"], row["top"] = kernel_breakdown(step)
            if os.environ.get("ACTORCORE_BENCH_SOURCES"):  # where the kernels were launched (a slower profile)
                model.zero_grad(set_to_none=True)
                row["sources"], row["idle_sources"] = kernel_sources(step)
        row["_lp"] = lp
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    print(f"[row] {json.dumps({k: v for k, v in row.items() if k not in ('top', '_lp')})}", flush=True)
    return row


def offload_layers(value: str) -> int | str:
    """``--offload-layers``: "auto" or a positive number of layers."""
    return value if value == "auto" else int(value)


def main() -> None:
    import actorcore as ac

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--pack-tokens", type=int, default=32768)
    parser.add_argument("--offload-layers", type=offload_layers, default="auto",
                        help="the '... offload' path: 'auto' (the layers the plan fully checkpoints) or how many of "
                             "the first layers' checkpointed inputs go to the host")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed steps after the first call (the plan of a budget changes once layers are measured)")
    parser.add_argument("--first-timeout", type=float, default=120.0, help="one timed call if the first is slower")
    parser.add_argument("--profile", default="actorcore before,actorcore fused", help="paths to profile")
    parser.add_argument("--single-json", default=None, help="one-GPU results, for the FSDP2 scaling efficiency")
    parser.add_argument("--mcore-experts", default="auto", choices=("auto", "grouped", "quack", "sequential"),
                        help="the megatron path's routed experts (build_gpt_model's moe_experts)")
    parser.add_argument("--mcore-fused", default="auto", choices=("auto", "on", "off"),
                        help="the megatron path's compiled layers (build_gpt_model's compiled_layers)")
    parser.add_argument("--mcore-swiglu", default="auto", choices=("auto", "quack", "off"),
                        help="the megatron path's dense MLPs on quack's gated GEMMs (build_gpt_model's swiglu_mlp)")
    parser.add_argument("--mcore-recompute", default="auto", choices=("auto", "selective", "full", "none"),
                        help="the megatron path's recompute ('auto' at --budget-gib)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to check the script (--model tiny[-moe])
    fsdp = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if fsdp:
        device = init_fsdp(device)
    rank, ranks = world()
    model_type, shape = MODELS[args.model]
    tiny = args.model.startswith("tiny")
    sequences, advs = batch_sequences(shape["vocab_size"], tiny)
    sequences, advs = sequences[rank::ranks], advs[rank::ranks]
    packs_idx = pack_greedy([torch.arange(s.numel()) for s in sequences], args.pack_tokens)
    order, packs, pack_advs, start = [], [], [], 0
    for p in packs_idx:
        packs.append(sequences[start: start + len(p)])
        pack_advs.append(advs[start: start + len(p)])
        order.append(list(range(start, start + len(p))))
        start += len(p)
    tokens = sum(s.numel() for s in sequences)
    total_tokens = all_ranks_tokens(tokens)

    reference = build(model_type, shape, torch.float32, device, args.layers)
    ref_packed = per_token_reference(reference, packs, device)
    ref_seq = [lp[int(a) + 1: int(b)] for pack, lp in zip(packs, ref_packed)
               for a, b in zip(ac.pack(pack).cu_seqlens[:-1], ac.pack(pack).cu_seqlens[1:])]
    del reference
    gc.collect()

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(model_type, shape, dtype, device, args.layers).train()
    active = active_parameters(model)
    if fsdp:
        shard_fsdp2(model)
    rows = []
    wanted = args.paths.split(",")
    if fsdp and any(not p.startswith("actorcore") for p in wanted):
        raise SystemExit("under torchrun only the actorcore paths run (FSDP2); pass --paths 'actorcore ...'")
    megatron = None  # (path, step, chunks): built once per Megatron path, reused by its " fa4" variant
    for name in ordered_paths(wanted):
        profile = name in args.profile.split(",")
        handle, runner = None, model
        attention = "fa4" if name.endswith(FA4_SUFFIX) else "auto"
        base = name.removesuffix(FA4_SUFFIX)
        if name.startswith("actorcore"):
            fused = base != "actorcore before"
            # no-ckpt: none (the model's own checkpointing is off here), so the compiled layers keep their compiled graphs
            ckpt = "full" if base == "actorcore before" else (None if "no-ckpt" in name else "auto")
            moe = bool(getattr(model.config, "num_experts", None))
            experts = "grouped" if moe and fused and "transformers-experts" not in name else False
            experts = "quack" if "quack-experts" in name else experts
            # offload: --offload-layers ("auto" or the first K) layers' checkpointed inputs to the host
            # (compiled_decoder="auto" compiles no layer with offload asked for, so the compiled decoder is asked for
            # by name)
            offload = False
            if "offload" in name:
                offload = (args.offload_layers if args.offload_layers == "auto"
                           else min(args.offload_layers, model.config.num_hidden_layers))
            try:
                handle = ac.patch_model(model, compiled_decoder=(True if offload else "auto") if fused else False,
                                        checkpointing=ckpt, memory_budget_gib=args.budget_gib if ckpt == "auto" else None,
                                        moe_experts=experts, swiglu_mlp="quack" if "quack-mlp" in name else False,
                                        attention_backend=attention, offload_activations=offload)
            except ValueError as refused:  # e.g. FA4 where it cannot run: a result, not the end of the run
                rows.append({"path": name, "error": f"refused: {refused}"})
                print(f"[row] {json.dumps(rows[-1])}", flush=True)
                continue
            step = actorcore_step(model, packs, pack_advs, device)
        elif base.startswith("megatron"):
            from actorcore.mcore.build.attention import use_attention_backend

            if megatron is None or megatron[0] != base:
                megatron = None  # the previous Megatron model is gone before the next one is built
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                megatron = (base, *megatron_step(model, packs, pack_advs, device, megatron_options(base, args),
                                                 fused_loss=base != "megatron before"))
            _, step, runner = megatron
            step = counted_attention(step, use_attention_backend(list(runner), attention))
        else:
            if "liger" in name:
                from liger_kernel.transformers import _apply_liger_kernel_to_instance

                _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False,
                                                cross_entropy=False)  # decoder patches; process-wide: run last
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            packed = order if name == "transformers packed" else None
            step = transformers_step(model, sequences, advs, device, args.micro_batch, packed)
        with (whole_layers_only() if "no-gate-up" in name else contextlib.nullcontext()), \
                (checkpointed_around(model) if "ckpt-around" in name else contextlib.nullcontext()):
            row = run_path(name, runner, step, tokens, active, profile, args.repeats, args.first_timeout, args.warmup)
        if getattr(step, "packs_seen", None) and "peak_gib" in row:  # per pack of the first and the last call
            row["peak_gib"] = max(p or 0.0 for call in step.packs_seen for _, p, _ in call)
            row["packs_first_call"], row["packs_last_call"] = step.packs_seen[0], step.packs_seen[-1]
        row = global_row(row, total_tokens)
        if "_lp" in row:
            lp = row.pop("_lp")
            if name.startswith(("actorcore", "megatron")):  # per pack
                row["max_dlp_vs_fp32"] = max((a - b).abs().max().item() for a, b in zip(lp, ref_packed))
            else:
                row["max_dlp_vs_fp32"] = max((a - b).abs().max().item() for a, b in zip(lp, ref_seq))
        if handle is not None or base.startswith("megatron"):
            row["trace"] = {k: v for k, v in step.trace.items() if k.split(":")[0] in (
                "compiled_decoder", "checkpoint", "moe_experts", "swiglu_mlp", "attention", "varlen_attention", "mcore",
                "offload")}
        if handle is not None:
            row["measured_bytes_per_token"] = measured_layer_bytes(model)
            row["attention_backend"] = handle.plan["attention"].line()
            handle.revert()
        if base.startswith("megatron"):
            row["choices"] = step.choices
        rows.append(row)
    if fsdp:
        add_scaling(rows, args.single_json, active)
    if rank != 0:
        return
    meta = {"model": args.model, "layers": model.config.num_hidden_layers, "tokens": total_tokens, "ranks": ranks,
            "packs_per_rank": len(packs),
            "active_parameters": active, "budget_gib": args.budget_gib, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    name = f"actor_step_{args.model}" + (f"_fsdp{ranks}" if fsdp else "")
    write_json(args.out, f"{name}.json", {"meta": meta, "rows": rows})
    print(json.dumps(meta))
    print(f"{'path':<28} {'s/step':>8} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'max|Δlp| fp32':>14}")
    print_rows(rows, "path", lambda r: f"{r['seconds']:8.3f} {r['tokens_per_s']:9.0f} {100 * r['mfu']:5.1f}% "
               f"{r['peak_gib']:9.1f} {r.get('max_dlp_vs_fp32', float('nan')):14.3e}  first {r['first_call_s']:.1f}s")
    for row in rows:
        if row.get("breakdown"):
            print(f"{row['path']:<28} kernels: {format_breakdown(row['breakdown'])}")


def measured_layer_bytes(model) -> dict[str, list[int]]:
    """What ``checkpointing="auto"`` measured the layers to keep, per mode: [least, most] bytes per token (the
    planner's inputs, against its estimate from the config)."""
    from actorcore.hf.patch import patch_state

    by_mode: dict[str, list[float]] = {}
    for (_, mode), value in patch_state(model).measured_layer_bytes.items():
        by_mode.setdefault(mode, []).append(value)
    return {mode: [round(min(v)), round(max(v))] for mode, v in sorted(by_mode.items())}


def add_scaling(rows: list[dict], single_json: str | None, active: float) -> None:
    """MFU over all ranks' GPUs and, given a one-GPU run, the scaling efficiency: (tokens/s on N) / (N x one)."""
    _, ranks = world()
    single = {}
    if single_json:
        with open(single_json) as f:
            single = {r["path"]: r for r in json.load(f)["rows"] if "tokens_per_s" in r}
    for row in rows:
        if "error" in row:
            continue
        row["mfu"] = mfu(active, row["tokens"], row["seconds"]) / ranks
        if row["path"] in single:
            row["scaling_efficiency"] = row["tokens_per_s"] / (ranks * single[row["path"]]["tokens_per_s"])


if __name__ == "__main__":
    main()
