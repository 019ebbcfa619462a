"""Where one actor step waits for the GPU: every host synchronisation that ``ac.compute_loss`` forward+backward
triggers on a packed batch, with the line of actorcore (or of torch / transformers) that asked for it.

A sync per call stalls the launch queue between micro-batches (the GPU idles while the host catches up), so the
step of a trainer that calls the model layer many times per batch pays it each time. Uses CUDA's sync debug mode
(``torch.cuda.set_sync_debug_mode("warn")``), after a first call that compiles.

    PYTHONPATH=src python3 bench/host_syncs.py [--model-type qwen2] [--fused auto|off]
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter

import torch


def main() -> None:
    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-type", default="qwen2")
    parser.add_argument("--fused", choices=("auto", "off"), default="auto")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host syncs are a CUDA question: run this on a GPU")
    model = build_tiny_model(args.model_type, seed=0, dtype=torch.bfloat16).cuda().train()
    # fused: no checkpointing (a compiled layer keeps its compiled graph); eager: selective checkpointing
    ac.patch_model(model, compiled_decoder="auto" if args.fused == "auto" else False,
                   checkpointing=None if args.fused == "auto" else "selective")
    g = torch.Generator().manual_seed(0)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (300, 41, 1000, 7)]).to("cuda")
    adv = torch.randn(batch.num_tokens, generator=g).cuda()

    def step():
        res = ac.compute_loss(model, batch, lambda lp, ent, a: -(lp * a), (adv,), entropy=False)
        res.loss.backward()

    step()  # compiles
    torch.cuda.synchronize()
    sites = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" not in str(w.message):
            continue
        sites[f"{w.filename}:{w.lineno}"] += 1  # the Python line whose op synchronised
    print(f"host syncs in one compute_loss forward+backward ({args.model_type}, fused {args.fused}): "
          f"{sum(sites.values())}")
    for site, n in sites.most_common():
        print(f"  {n:4d}  {site}")


if __name__ == "__main__":
    main()
