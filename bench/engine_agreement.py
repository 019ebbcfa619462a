"""Trainer-engine agreement in bfloat16, measured against the real engine (vLLM's CPU build, on the CPU).

For every family the engine tier runs exactly in float32 (``actorcore.testing.engines.ENGINE_FAMILIES``): the tiny
model in bfloat16 in vLLM and in actorcore, one bridge update after an optimizer step, then the agreement of the
engine's processed log-probs of the tokens it samples (temperature 1.0 and 0.7) with actorcore's on the same bf16
weights (``rollout_agreement``: max and mean |dlogp|, the k3 KL estimate, the share beyond 0.01 nats), and the
bridge's probe. Also the float32 row of each family for comparison.

    PYTHONPATH=src python bench/engine_agreement.py [--families qwen3,qwen3_moe] [--json out.json]

Run in the engine environment (``.venv/engine``, which ``make test`` builds). This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402


def measure(model_type: str, overrides: dict, dtype: torch.dtype, root: str, keep: list) -> dict:
    from actorcore.engines import VllmBridge, rollout_agreement
    from actorcore.export import hf_weight_stream
    from actorcore.testing.engines import PROMPTS, engine_model, sample, save_for_engine, start_engine, training_step

    model = engine_model(model_type, overrides, dtype=dtype)
    llm = start_engine(save_for_engine(model, os.path.join(root, f"{model_type}-{dtype}")),
                       dtype=str(dtype).removeprefix("torch."))
    keep.append(llm)
    training_step(model, torch.optim.Adam(model.parameters(), lr=2e-2), seed=1)
    report = VllmBridge(llm).update(hf_weight_stream(model), reference=model)
    row = {"family": model_type, "dtype": str(dtype).removeprefix("torch."), "probe_max": report.probe.max_abs,
           "probe_mean": report.probe.mean_abs}
    for temperature in (1.0, 0.7):
        completions, engine_lp = sample(llm, PROMPTS * 4, temperature, seed=7, max_tokens=16)
        agreement = rollout_agreement(model, PROMPTS * 4, completions, engine_lp, temperature=temperature,
                                      threshold=0.01)
        row[f"T{temperature}"] = agreement.summary()
    return row


def main() -> None:
    from actorcore.testing.engines import ENGINE_FAMILIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(ENGINE_FAMILIES))
    parser.add_argument("--json")
    args = parser.parse_args()
    families = args.families.split(",")
    keep: list = []  # vLLM tears its process-wide groups down with a collected engine: keep every engine
    rows = []
    with tempfile.TemporaryDirectory() as root:
        order = sorted(families, key=lambda f: "moe" not in f and f != "mixtral")  # a MoE engine first
        for family in order:
            for dtype in (torch.bfloat16, torch.float32):
                rows.append(measure(family, ENGINE_FAMILIES[family][0], dtype, root, keep))
                r = rows[-1]
                print(f"{r['family']:<12} {r['dtype']:<9} probe max {r['probe_max']:.2e}  "
                      + "  ".join(f"T={t}: max {r[f'T{t}']['max_abs']:.2e} mean {r[f'T{t}']['mean_abs']:.2e} "
                                  f"k3 {r[f'T{t}']['k3_kl']:.1e} >0.01 {r[f'T{t}']['fraction_beyond']:.3f}"
                                  for t in (1.0, 0.7)), flush=True)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
