"""actorcore's packed log-probs against the padding-free setups verl and TRL users run, in one model on one GPU.

The model and batch of ``bench/hf_route.py`` (Qwen2.5-1.5B's shape, random weights, bf16, activation
checkpointing; 32 sequences of 128-4096 tokens, seed 1). Each path computes per-token log-probs and entropy of
every token after its sequence's first; forward-only (old/ref log-probs) and forward+backward of
``sum(log_probs) + sum(entropy)`` (actor update) are timed.

Paths:
  actorcore packed          ``ac.compute_logprobs`` (varlen attention, fused fp32 log-prob head)
  hf packed <attn>          plain transformers' own packing: one row, position ids restarting per sequence,
                            ``cu_seq_lens_*`` / ``max_length_*`` kwargs, ``attn_implementation`` = sdpa or
                            flex_attention; the head is TRL's pure-torch ``selective_log_softmax`` +
                            ``entropy_from_logits`` on the bf16 logits (bench/_trl_logps.py)
  trl padded                TRL's padded path: right-padded micro-batches (``--micro-batch``), sdpa,
                            ``logits[:, :-1]``, TRL's ``selective_log_softmax`` + ``entropy_from_logits``
  verl head                 actorcore's packed decoder, then verl 0.9.1's fused torch head
                            (``FusedLinearForPPO``, chunk 512; bench/_verl_head.py) on its hidden states: the head
                            verl runs with ``use_fused_kernels=True``, compared with actorcore's in the same model

Per path: median time, tokens/s (real tokens), extra peak memory (peak allocated minus allocated before the
call, gradients included), max |Δ log-prob| and |Δ entropy| against actorcore's forward, and an isolation
check for every packed path: the same sequence B packed after two different sequences A and A' of equal
length; max |Δ log-prob| on B between the two (0 when the packing isolates sequences; large when attention
leaks across the boundary). Writes ``padding_free.json`` and ``padding_free.md`` to ``--out``.

    PYTHONPATH=src python3 bench/padding_free.py --out $OUT/padding_free   # H200
    PYTHONPATH=src python3 bench/padding_free.py --tiny --out /tmp/pf      # CPU check of the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _trl_logps import entropy_from_logits, selective_log_softmax  # noqa: E402
from _verl_head import verl_fused_linear_for_ppo  # noqa: E402
from hf_route import QWEN25_15B, TINY, model_and_sequences  # noqa: E402
from hf_route import _measure as measure  # noqa: E402

PATHS = ("actorcore packed", "hf packed sdpa", "hf packed flex_attention", "trl padded", "verl head")
GiB = 2**30


def _measure(fn, repeats: int, model) -> tuple[float, float, tuple]:
    """(median seconds, extra peak GiB, last result), gradients zeroed around every call; one timed run when the
    warm-up (compilation for flex_attention) took over 10 s."""
    return measure(fn, repeats, before=lambda: model.zero_grad(set_to_none=True), single_if_slower_than=10)


def _scored(pred_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Predicting-position values (``pred[t]`` is about token ``t + 1``) -> actorcore's scored alignment:
    ``out[t]`` about token ``t``, 0 at each sequence's first token (the cross-boundary predictions drop out)."""
    out = torch.zeros_like(pred_T, dtype=torch.float32)
    out[1:] = pred_T[:-1].float()
    return out.index_fill(0, cu_seqlens[:-1].long(), 0.0)


def _paths(model, batch, padded, lengths):
    """name -> fn(train) returning ``(log_probs [T], entropy [T])`` in actorcore's scored alignment."""
    import actorcore as ac
    from actorcore.hf.decoder import decoder_call, run_decoder

    cu = batch.cu_seqlens

    def finish(lp, ent, train):
        if train:
            (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach()

    def actorcore_packed(train):
        model.set_attn_implementation("sdpa")
        model.train(train)
        with torch.set_grad_enabled(train):
            out = ac.compute_logprobs(model, batch)
            return finish(out.log_probs, out.entropy, train)

    def hf_packed(attn):
        def run(train):
            model.set_attn_implementation(attn)
            model.train(train)
            cu32 = cu.to(torch.int32)
            with torch.set_grad_enabled(train):
                logits = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                               use_cache=False, cu_seq_lens_q=cu32, cu_seq_lens_k=cu32,
                               max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen).logits
                labels = torch.roll(batch.input_ids, -1)[None]
                lp = _scored(selective_log_softmax(logits, labels)[0], cu)
                ent = _scored(entropy_from_logits(logits)[0], cu)
                return finish(lp, ent, train)
        return run

    def trl_padded(train):
        model.set_attn_implementation("sdpa")
        model.train(train)
        lps, ents = [], []
        for ids, mask in padded:
            with torch.set_grad_enabled(train):
                position_ids = (mask.cumsum(1) - 1).clamp(min=0)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                               use_cache=False).logits[:, :-1]
                lp = selective_log_softmax(logits, ids[:, 1:])
                ent = entropy_from_logits(logits)
                keep = mask[:, 1:].bool()
                if train:
                    (lp[keep].sum() + ent[keep].sum()).backward()
            for row, n in enumerate(mask.sum(1).tolist()):  # back to the packed [T] layout
                lps += [lp.new_zeros(1), lp[row, :n - 1].detach().float()]
                ents += [ent.new_zeros(1), ent[row, :n - 1].detach().float()]
        return torch.cat(lps), torch.cat(ents)

    def verl_head(train):
        model.set_attn_implementation("sdpa")
        model.train(train)
        with torch.set_grad_enabled(train):
            hidden_TD = run_decoder(decoder_call(model, batch))
            lp, ent = verl_fused_linear_for_ppo(hidden_TD, model.get_output_embeddings().weight,
                                                torch.roll(batch.input_ids, -1))
            return finish(_scored(lp, cu), _scored(ent, cu), train)

    return {"actorcore packed": actorcore_packed, "hf packed sdpa": hf_packed("sdpa"),
            "hf packed flex_attention": hf_packed("flex_attention"), "trl padded": trl_padded,
            "verl head": verl_head}


def _isolation(name, model, config, device, a_len, b_len) -> float | None:
    """max |Δ log-prob| on sequence B packed after A and after A' (same length, other tokens)."""
    import actorcore as ac
    from actorcore.hf.reference import right_padded

    g = torch.Generator().manual_seed(7)
    a, a2, b = (torch.randint(0, config.vocab_size, (n,), generator=g) for n in (a_len, a_len, b_len))
    outs = []
    for first in (a, a2):
        batch = ac.pack([first, b]).to(device)
        padded = [tuple(t.to(device) for t in right_padded([first, b]))]
        with torch.no_grad():
            lp, _ = _paths(model, batch, padded, [a_len, b_len])[name](False)
        outs.append(lp[a_len:].float())
    return (outs[0] - outs[1]).abs().max().item()


def _leaky_control(model, config, device, a_len, b_len) -> float:
    """The isolation check on a packing that does leak (one causal row, positions never restarting): must be > 0,
    else the check could not see a leak."""
    g = torch.Generator().manual_seed(7)
    a, a2, b = (torch.randint(0, config.vocab_size, (n,), generator=g) for n in (a_len, a_len, b_len))
    model.set_attn_implementation("sdpa")
    model.eval()
    outs = []
    for first in (a, a2):
        ids = torch.cat([first, b]).to(device)[None]
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        outs.append(selective_log_softmax(logits, ids[:, 1:])[0, a_len:].float())
    return (outs[0] - outs[1]).abs().max().item()


def main() -> None:
    import actorcore as ac
    from actorcore.hf.reference import right_padded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per padded (TRL) call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (to check the script)")
    parser.add_argument("--out", required=True, help="directory for padding_free.json and padding_free.md")
    args = parser.parse_args()
    chosen = {p.strip() for p in args.paths.split(",") if p.strip()}
    paths = [p for p in PATHS if p in chosen]  # actorcore packed first: the reference of the others
    unknown = sorted(chosen - set(PATHS))
    if unknown or "actorcore packed" not in paths:
        parser.error(f"--paths: unknown {unknown}; 'actorcore packed' (the reference) must be included")

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.tiny:
        args.sequences, args.min_len, args.max_len = min(args.sequences, 6), 8, 48
    model, sequences, _ = model_and_sequences("qwen2", TINY if args.tiny else QWEN25_15B, device, args.sequences,
                                           args.min_len, args.max_len)
    config, dtype = model.config, model.dtype
    lengths = [len(s) for s in sequences]
    batch = ac.pack(sequences).to(device)
    padded = [tuple(t.to(device) for t in right_padded(sequences[i:i + args.micro_batch]))
              for i in range(0, len(sequences), args.micro_batch)]
    fns = _paths(model, batch, padded, lengths)

    rows: dict[str, dict] = {}
    ref = None
    for name in paths:
        for train in (False, True):
            key = f"{name}, {'forward+backward' if train else 'forward'}"
            row = {"path": name, "mode": "fwd+bwd" if train else "fwd"}
            try:
                seconds, peak, (lp, ent) = _measure(lambda: fns[name](train), args.repeats, model)
                if ref is None:
                    ref = (lp, ent)
                row.update(seconds=seconds, tokens_per_s=batch.num_tokens / seconds,
                           extra_peak_gib=peak if device == "cuda" else None,
                           max_abs_dlogprob_vs_actorcore=(lp - ref[0]).abs().max().item(),
                           max_abs_dentropy_vs_actorcore=(ent - ref[1]).abs().max().item())
            except torch.OutOfMemoryError:
                row.update(error="out of memory")
            except Exception as exc:  # a path that cannot run here is reported, not fatal to the others
                row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            rows[key] = row
            print(key, {k: v for k, v in row.items() if k not in ("path", "mode")}, flush=True)
        if name != "trl padded":
            try:
                iso = _isolation(name, model, config, device, a_len=min(args.max_len, 1024) // 2,
                                 b_len=min(args.max_len, 1024))  # the same sizes as iso_args below
            except Exception as exc:
                iso = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            for train in ("forward", "forward+backward"):
                rows[f"{name}, {train}"]["isolation_max_abs_dlogprob"] = iso
            print(f"{name}: isolation {iso}", flush=True)

    iso_args = dict(a_len=min(args.max_len, 1024) // 2, b_len=min(args.max_len, 1024))
    meta = {
        "isolation_check_on_a_leaking_packing": _leaky_control(model, config, device, **iso_args),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "model": "qwen2 tiny" if args.tiny else "Qwen2.5-1.5B shape, random weights",
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9, "sequences": len(sequences),
        "tokens": batch.num_tokens, "padded_tokens": sum(ids.numel() for ids, _ in padded),
        "micro_batch": args.micro_batch, "repeats": args.repeats, "activation_checkpointing": True,
        "command": " ".join(sys.argv),
    }
    os.makedirs(args.out, exist_ok=True)
    _write(os.path.join(args.out, "padding_free.json"), json.dumps({"meta": meta, "rows": rows}, indent=1))
    _write(os.path.join(args.out, "padding_free.md"), _markdown(meta, rows))
    print(_markdown(meta, rows))


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _fmt(v, spec, unit=""):
    return "n/a" if v is None else v if isinstance(v, str) else format(v, spec) + unit


def _markdown(meta: dict, rows: dict) -> str:
    lines = [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| path | time | tokens/s | extra peak memory | max \\|Δ log-prob\\| vs actorcore | "
              "max \\|Δ entropy\\| vs actorcore | isolation max \\|Δ log-prob\\| |", "|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        if "error" in r:
            lines.append(f"| {key} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {key} | {r['seconds'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | "
                     f"{_fmt(r['extra_peak_gib'], '.2f', ' GiB')} | {r['max_abs_dlogprob_vs_actorcore']:.1e} | "
                     f"{r['max_abs_dentropy_vs_actorcore']:.1e} | "
                     f"{_fmt(r.get('isolation_max_abs_dlogprob'), '.1e')} |")
    lines.append("")
    for mode, label in (("fwd", "forward"), ("fwd+bwd", "forward+backward")):
        ours = rows.get(f"actorcore packed, {label}")
        for key, r in rows.items():
            if r["mode"] != mode or r["path"] == "actorcore packed" or "error" in r or not ours or "error" in ours:
                continue
            mem = ""
            if ours["extra_peak_gib"] and r["extra_peak_gib"]:
                mem = f", {r['extra_peak_gib'] / ours['extra_peak_gib']:.2f}x the extra memory"
            lines.append(f"- {label}: {r['path']} takes {r['seconds'] / ours['seconds']:.2f}x actorcore's time{mem}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
