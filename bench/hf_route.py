"""End-to-end log-probs on the HF route: actorcore packed vs plain transformers, padded micro-batches and its
own packing (one row, position ids restarting per sequence, ``cu_seq_lens`` passed as transformers documents).

One process, one GPU, a randomly initialised model of a real shape, bf16, an RL-like batch of sequences of
very different lengths. For each path: forward-only (old/ref log-probs) and forward+backward (actor update)
time, extra peak memory, and max |Δ log-prob| of each path against the packed forward (whose head computes
fp32 logits; plain transformers rounds logits to bf16). A packing that leaks across sequences (a hybrid
model's linear attention run over the whole stream) shows up as a large |Δ|.

    PYTHONPATH=src python3 bench/hf_route.py [--model qwen2.5-1.5b | qwen3.5-2b] [--sequences 32 --min-len 128
        --max-len 4096 --micro-batch 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter

import torch

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1e6)
# A Qwen3.5-shaped hybrid of about 2B parameters: three Gated DeltaNet layers to one gated full-attention layer.
QWEN35_2B = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, max_position_embeddings=32768, tie_word_embeddings=True,
                 layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
TINY_HYBRID = dict(TINY, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "full_attention"] * 2)
MODELS = {"qwen2.5-1.5b": ("qwen2", QWEN25_15B, TINY), "qwen3.5-2b": ("qwen3_5_text", QWEN35_2B, TINY_HYBRID)}


def model_and_sequences(model_type: str, shape: dict, device: str, sequences: int, min_len: int, max_len: int,
                        checkpointing: dict | None = None):
    """The benchmark's randomly initialised model (seed 0; bf16 on the GPU, fp32 on the CPU, activation
    checkpointing on) and its RL-like batch of ``sequences`` token sequences of ``min_len..max_len`` tokens (seed 1),
    with the generator that drew them (for scripts that draw more): one definition for every bench script that runs
    this batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = AutoConfig.for_model(model_type, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(min_len, max_len + 1, (sequences,), generator=g).tolist()
    return model, [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths], g


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measure(fn, repeats: int, warmup: bool = True, before=None,
             single_if_slower_than: float | None = None) -> tuple[float, float, object]:
    """(median seconds, extra peak GiB, last result). ``before`` runs ahead of every call (e.g. zeroing
    gradients); a warm-up slower than ``single_if_slower_than`` seconds leaves one timed run."""
    if before is not None:
        before()
    if warmup:
        start = time.perf_counter()
        fn()
        _sync()
        if single_if_slower_than is not None and time.perf_counter() - start > single_if_slower_than:
            repeats = 1
    _sync()
    times, peak = [], 0.0
    result = None
    for _ in range(repeats):
        if before is not None:
            before()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = fn()
        _sync()
        times.append(time.perf_counter() - start)
        if torch.cuda.is_available():
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
    if before is not None:
        before()
    return sorted(times)[len(times) // 2], peak, result


@contextlib.contextmanager
def transformers_torch_delta_rule(model, train: bool):
    """Plain transformers picks flash-linear-attention's delta rule at import when fla is installed; fla 0.6 refuses
    its backward on Hopper with Triton < 3.7.1 (fla #640). There, plain transformers trains on its own torch delta
    rule (the function its fla wrapper falls back to), as actorcore does; forward-only keeps fla on both sides."""
    from actorcore.kernels.linear_attention.packed import fla_delta_rule_refusal

    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is None or not train or not torch.cuda.is_available() or not fla_delta_rule_refusal(torch.device("cuda")):
        yield
        return
    module = sys.modules[type(layer).__module__]
    wrapped = module.torch_chunk_gated_delta_rule
    module.torch_chunk_gated_delta_rule = getattr(wrapped, "__wrapped__", wrapped)
    try:
        yield
    finally:
        module.torch_chunk_gated_delta_rule = wrapped


def main() -> None:
    import actorcore as ac
    from actorcore.hf.reference import logprobs_from_logits, padded_position_ids, right_padded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per padded transformers call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (to check the script)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--paths", default="actorcore packed,transformers padded,transformers packed",
                        help="comma-separated subset of the paths (actorcore packed always runs: it is the reference)")
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated subset of fwd, fwd+bwd")
    parser.add_argument("--no-warmup", action="store_true", help="time the first call (for very slow paths)")
    args = parser.parse_args()

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    model_type, shape, tiny_shape = MODELS[args.model]
    model, sequences, _ = model_and_sequences(model_type, tiny_shape if args.tiny else shape, device, args.sequences,
                                           args.min_len, args.max_len)
    dtype = model.dtype
    batch = ac.pack(sequences).to(device)
    micro = [sequences[i : i + args.micro_batch] for i in range(0, len(sequences), args.micro_batch)]
    padded = [tuple(t.to(device) for t in right_padded(m)) for m in micro]

    paths = Counter()

    def packed(train: bool):
        model.train(train)
        with torch.set_grad_enabled(train):
            paths.clear()
            out = ac.compute_logprobs(model, batch, trace=paths)
            if train:
                (out.log_probs.sum() + out.entropy.sum()).backward()
        return out.log_probs.detach()

    def plain_packed(train: bool):
        model.train(train)
        cu = batch.cu_seqlens.to(torch.int32)
        with torch.set_grad_enabled(train), transformers_torch_delta_rule(model, train):
            logits = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False,
                           cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen,
                           max_length_k=batch.max_seqlen).logits[0]
            logp = torch.log_softmax(logits.float(), -1)
            lp = torch.zeros(batch.num_tokens, device=device)
            lp[1:] = logp[:-1].gather(-1, batch.input_ids[1:, None])[:, 0]
            ent = torch.zeros_like(lp)
            ent[1:] = -(logp[:-1].exp() * logp[:-1]).sum(-1)
            starts = batch.cu_seqlens[:-1].long()
            lp, ent = lp.index_fill(0, starts, 0.0), ent.index_fill(0, starts, 0.0)
            if train:
                (lp.sum() + ent.sum()).backward()
        return lp.detach()

    def plain(train: bool):
        model.train(train)
        parts = []
        for ids, mask in padded:
            with torch.set_grad_enabled(train), transformers_torch_delta_rule(model, train):
                logits = model(input_ids=ids, attention_mask=mask, position_ids=padded_position_ids(mask),
                               use_cache=False).logits
                lp, ent = logprobs_from_logits(logits, ids, mask)
                if train:
                    (lp.sum() + ent.sum()).backward()
            parts.append(lp.detach()[mask.bool()])
        return torch.cat(parts)

    rows = {}
    for name, fn in (("actorcore packed", packed), ("transformers padded", plain),
                     ("transformers packed", plain_packed)):
        if name not in args.paths.split(",") and name != "actorcore packed":
            continue
        for train in (False, True):
            key = f"{name} {'fwd+bwd' if train else 'fwd'}"
            if key.split(" ")[-1] not in args.modes.split(",") and not (name == "actorcore packed" and not train):
                continue
            try:
                seconds, peak, lp = _measure(lambda: fn(train), args.repeats, warmup=not args.no_warmup)
                rows[key] = {"seconds": seconds, "extra_peak_gib": peak, "log_probs": lp}
            except torch.OutOfMemoryError:
                rows[key] = {"seconds": None, "extra_peak_gib": None, "log_probs": None, "error": "OOM"}
            except (ValueError, RuntimeError) as error:  # e.g. transformers refusing packed input it cannot keep apart
                if name == "actorcore packed":
                    raise
                rows[key] = {"seconds": None, "extra_peak_gib": None, "log_probs": None,
                             "error": f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"}
            model.zero_grad(set_to_none=True)
            r = rows[key]
            print(f"[cell] {key}: " + (f"{r['seconds']:.3f} s, +{r['extra_peak_gib']:.2f} GiB" if r["seconds"]
                                      else r["error"]), flush=True)
        if name == "actorcore packed":
            rows["actorcore paths"] = dict(paths)  # the kernels the last (training) call ran
    ref = rows["actorcore packed fwd"]["log_probs"]
    tokens = batch.num_tokens
    padded_tokens = sum(ids.numel() for ids, _ in padded)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"device {device}, {dtype}, model {model_type} {'tiny' if args.tiny else args.model + ' shape'} "
          f"({params:.2f}B parameters), "
          f"{len(sequences)} sequences, {tokens} tokens ({padded_tokens} padded in micro-batches of "
          f"{args.micro_batch}), activation checkpointing on")
    print(f"{'path':<34} {'time':>10} {'tokens/s':>10} {'extra peak':>11} {'max|Δ lp| vs packed':>20}")
    print(f"actorcore paths (forward+backward call): {rows.pop('actorcore paths')}")
    for key, r in rows.items():
        if r["seconds"] is None:
            print(f"{key:<34} {r['error']}")
            continue
        diff = (r["log_probs"].float() - ref.float()).abs().max().item()
        print(f"{key:<34} {r['seconds'] * 1e3:>8.1f}ms {tokens / r['seconds']:>10.0f} "
              f"{r['extra_peak_gib']:>9.2f}GiB {diff:>20.2e}")
    for train in ("fwd", "fwd+bwd"):
        a = rows.get(f"actorcore packed {train}")
        for other in ("transformers padded", "transformers packed"):
            b = rows.get(f"{other} {train}")
            if a is None or b is None:
                continue
            if a["seconds"] and b["seconds"]:
                print(f"{train}: actorcore is {b['seconds'] / a['seconds']:.2f}x faster than {other}, uses "
                      f"{b['extra_peak_gib'] / max(a['extra_peak_gib'], 1e-9):.2f}x less extra memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "log_probs"} for k, v in rows.items()}, f,
                      indent=1)


if __name__ == "__main__":
    main()
