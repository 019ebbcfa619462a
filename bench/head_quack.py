"""The loss-fused head's three stages on quack's CuTe DSL GEMMs against what the head runs today.

quack's SM90 GEMMs are warp-specialised (a producer warp issues TMA loads, one or two consumer warp groups run the
MMAs, the epilogue of one tile overlaps the next tile's loads), which the head's Triton kernels are not. This times,
per 2048-token chunk and 16 chunks back to back (N=32768, H=4096, V=151936 by default):

- the forward statistics: the head's Triton kernel (logits, fp32 statistics, fp16 z - m store) against a quack GEMM
  whose epilogue computes the same from the fp32 accumulators (the benchmark variant ``bench/quack_stats.py``,
  at three tile shapes), and against quack's own
  linear-cross-entropy epilogue (bf16 exp(z - k), no entropy) and a plain bf16 cuBLAS matmul;
- grad_hidden = G @ W: cuBLAS against quack's GEMM;
- grad_weight += G^T h: cuBLAS addmm against quack's GEMM with C and against its TMA reduce-add store into bf16.

It checks the quack statistics per token against fp32 logits (log-prob, entropy, the stored z - m) and every GEMM
against cuBLAS, so a fast wrong kernel shows. Needs quack-kernels and the CuTe DSL (Hopper).

    PYTHONPATH=src python3 bench/head_quack.py [--tokens 32768 --hidden 4096 --vocab 151936] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logprob import median_ms  # noqa: E402

CHUNK = 2048


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from actorcore.kernels.logprob._common import finish_stats, merge_partial_stats
    from quack_stats import TILE_N, _stats_epilogue, tile_partials
    from actorcore.kernels.logprob.triton_engine import TritonEngine, padded_row

    torch.manual_seed(0)
    n, d, v, inv_t = args.tokens, args.hidden, args.vocab, 1.0 / args.temperature
    chunks = n // CHUNK
    h = torch.randn(CHUNK, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, d, device="cuda") * (3.0 / d**0.5)).to(torch.bfloat16)
    y = torch.randint(0, v, (CHUNK,), device="cuda")
    chunk_flop = 2 * CHUNK * d * v
    rows = []

    def record(label, f, flop=chunk_flop * chunks, note=""):
        try:
            ms = median_ms(f)
            line = f"{label:78s} {ms:8.2f} ms {flop / ms / 1e9:6.0f} TFLOP/s {note}"
        except Exception as err:  # noqa: BLE001 - a kernel that fails to build is reported, not fatal
            ms = None
            line = f"{label:78s} FAILED {type(err).__name__}: {str(err)[:300]}"
        print(line, flush=True)
        rows.append({"label": label, "ms": ms, "note": note})
        return ms

    def repeat(f):
        def run():
            for _ in range(chunks):
                f()
        return run

    # fp32 reference of one chunk
    z32 = (h.float() @ w.float().t()) * inv_t
    lse_ref = torch.logsumexp(z32, -1)
    logp_ref = z32.gather(1, y[:, None]).squeeze(1) - lse_ref
    p = torch.exp(z32 - lse_ref[:, None])
    ent_ref = lse_ref - (p * z32).sum(-1)
    del p

    # -- forward statistics
    eng = TritonEngine()
    z16 = torch.empty(CHUNK, padded_row(v), dtype=torch.float16, device="cuda")[:, :v]
    shift = torch.empty(CHUNK, -(-v // eng._shift_cols()), dtype=torch.float32, device="cuda")

    def ours():
        return eng._stats_and_shifted_logits(h, w, y, z16, shift, args.temperature, None, True)

    record("forward: Triton fused kernel (today), fp16 z - m store", repeat(ours))
    _, lp, ent = finish_stats(*ours())
    print(f"  accuracy: logprob {(lp - logp_ref).abs().max().item():.2e}  entropy {(ent - ent_ref).abs().max().item():.2e}")
    record("forward floor: cuBLAS bf16 mm into bf16 logits", repeat(lambda: torch.mm(h, w.t())))

    try:
        epi = _stats_epilogue()  # bench/quack_stats.py's epilogue, at other tile shapes too
    except Exception as err:  # noqa: BLE001
        epi = None
        print(f"quack not importable: {type(err).__name__}: {err}")
    if epi is not None:
        for tile_m, cluster_m, pingpong in ((128, 2, True), (128, 2, False), (256, 1, False)):
            tile_n = TILE_N  # one stored maximum per 128 columns: what the grad_logits pass reads
            t = v // tile_n
            dz = torch.empty(CHUNK, v, dtype=torch.float16, device="cuda")
            k_ = torch.empty(CHUNK, t, device="cuda")
            s_, q_ = torch.empty_like(k_), torch.empty_like(k_)
            zy = torch.zeros(CHUNK, device="cuda")

            def quack_stats(tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m, pingpong=pingpong, dz=dz, k_=k_,
                            s_=s_, q_=q_, zy=zy):
                epi.gemm(h, w, dz, epi_args=dict(max_log2=tile_n, max_log2_out=k_, sum_exp=s_, sum_dexp=q_,
                                                 target=y, target_logit=zy, inv_t=inv_t),
                         tile_M=tile_m, tile_N=tile_n, cluster_M=cluster_m, cluster_N=1, pingpong=pingpong)

            label = f"forward: quack GEMM + statistics epilogue, fp16 store, {tile_m}x{tile_n} c{cluster_m}" + (
                " pingpong" if pingpong else " cooperative")
            ms = record(label, repeat(quack_stats))
            if ms is None:
                continue
            quack_stats()
            shift = torch.empty_like(k_)
            _, lp, ent = finish_stats(*merge_partial_stats(*tile_partials(k_, s_, q_, zy, inv_t, shift)))
            dz_err = (dz.float() - (z32 - shift.repeat_interleave(tile_n, dim=1))).abs().max().item()
            print(f"  accuracy: logprob {(lp - logp_ref).abs().max().item():.2e}  entropy "
                  f"{(ent - ent_ref).abs().max().item():.2e}  stored z - m {dz_err:.2e}", flush=True)
            del dz, k_, s_, q_, zy
        try:
            from quack.epilogue.scaled_exp import scaled_exp_target_epi

            t = v // 128
            e16 = torch.empty(CHUNK, v, dtype=torch.bfloat16, device="cuda")
            kk, se, zy = torch.empty(CHUNK, t, device="cuda"), torch.empty(CHUNK, t, device="cuda"), torch.empty(
                CHUNK, device="cuda")
            record("forward: quack's linear-cross-entropy epilogue (bf16 exp, no entropy), 128x128 pingpong",
                   repeat(lambda: scaled_exp_target_epi.gemm(
                       h, w, e16, epi_args=dict(max_log2=128, sum_exp=se, max_log2_out=kk, target=y, target_logit=zy),
                       tile_M=128, tile_N=128, cluster_M=2, cluster_N=1, pingpong=True)))
            del e16
        except Exception as err:  # noqa: BLE001
            print(f"quack scaled_exp: {type(err).__name__}: {err}")
    del z32
    torch.cuda.empty_cache()

    # -- the two gradient GEMMs
    g = (torch.randn(CHUNK, v, device="cuda") * 1e-3).to(torch.bfloat16)
    gh = torch.empty(CHUNK, d, dtype=torch.bfloat16, device="cuda")
    record("grad_hidden: cuBLAS mm G @ W", repeat(lambda: torch.mm(g, w, out=gh)))
    ref_gh = gh.clone()
    gw = torch.zeros(v, d, dtype=torch.bfloat16, device="cuda")
    record("grad_weight: cuBLAS addmm_ W += G^T h (today)", repeat(lambda: gw.addmm_(g.t(), h)))
    ref_gw = torch.mm(g.t(), h)
    try:
        from quack.epilogue.library import identity_epi
        from quack.gemm_interface import gemm, gemm_add_inplace

        def close(label, got, ref):
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            print(f"  {label}: max error / max {err:.2e}", flush=True)

        record("grad_hidden: quack gemm G @ W (default config)", repeat(lambda: gemm(g, w, out=gh, tuned=False)))
        close("grad_hidden quack vs cuBLAS", gh, ref_gh)
        record("grad_weight: quack gemm_add_inplace W += G^T h", repeat(
            lambda: gemm_add_inplace(g.t(), h, gw, tuned=False)))
        gw.zero_()
        gemm_add_inplace(g.t(), h, gw, tuned=False)
        close("grad_weight quack add vs cuBLAS", gw, ref_gw)

        def reduce_add():
            identity_epi.gemm(g.mT, h.mT, gw, epi_args={}, add_to_output=True, tile_M=128, tile_N=256,
                              cluster_M=2, cluster_N=1)

        record("grad_weight: quack GEMM, TMA reduce-add into bf16 W", repeat(reduce_add))
        gw.zero_()
        reduce_add()
        close("grad_weight quack reduce-add vs cuBLAS", gw, ref_gw)
    except Exception as err:  # noqa: BLE001
        print(f"quack GEMMs: {type(err).__name__}: {err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": n, "hidden": d, "vocab": v, "chunk": CHUNK, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
