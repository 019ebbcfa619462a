"""Measure what ``actorcore.verify`` sees per dtype: the numbers behind ``VERIFY_TOLERANCE`` (CPU is enough).

For every registered text arch's tiny test model and the embedded qwen3, seeds 0-2, random token ids of
lengths 7, 13, 31, 64, 129, 257: the largest per-token |Δ log-prob| and |Δ entropy| between
``compute_logprobs`` and the model's own forward, one line per (dtype, model).

    PYTHONPATH=src python3 bench/verify_tolerances.py [--dtypes float32,bfloat16,float16] [--archs llama,qwen3]
"""

from __future__ import annotations

import argparse

import torch

import actorcore as ac
from actorcore.hf.embedded import build_text_model
from actorcore.testing.tiny_configs import TINY_CONFIGS, build_tiny_model

LENGTHS = (7, 13, 31, 64, 129, 257)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--archs", default=",".join(TINY_CONFIGS))
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for arch in [*args.archs.split(","), "embedded"]:
            lp = ent = 0.0
            for seed in range(args.seeds):
                model = (build_text_model(seed=seed, dtype=dtype) if arch == "embedded"
                         else build_tiny_model(arch, seed=seed, dtype=dtype))
                g = torch.Generator().manual_seed(seed)
                vocab = model.get_input_embeddings().num_embeddings
                batch = ac.pack([torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS])
                report = ac.verify(model, batch, tolerance=float("inf"))
                lp, ent = max(lp, report.max_abs_diff_logprob), max(ent, report.max_abs_diff_entropy)
            print(f"{str(dtype):<15} {arch:<12} max|Δ log-prob| {lp:.2e}  max|Δ entropy| {ent:.2e}", flush=True)


if __name__ == "__main__":
    main()
