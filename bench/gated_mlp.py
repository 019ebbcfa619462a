"""One SwiGLU MLP, forward+backward over one pack of tokens: the compiled transformers MLP (what the compiled decoder
runs) against quack's gated MLP (``kernels.quack.gated_mlp``: SwiGLU in the epilogues of two quack GEMMs, the other
four on cuBLAS), eager and compiled, in one process on one GPU. Per variant: milliseconds (CUDA events, median of
``--repeats``), the kernel-time breakdown by category (``step_profile``), and the max error of the output and the
input gradient against fp32 math from the same bf16 values, relative to the max magnitude.

    PYTHONPATH=src:/tmp/site python3 bench/gated_mlp.py [--shapes 1536x8960,4096x12288] [--tokens 32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logprob import median_ms  # noqa: E402  (bench/logprob.py, beside this script)
from step_profile import format_breakdown, kernel_breakdown, write_json  # noqa: E402


def build_mlp(hidden: int, intermediate: int) -> torch.nn.Module:
    from transformers import AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    config = AutoConfig.for_model("qwen2", hidden_size=hidden, intermediate_size=intermediate)
    torch.manual_seed(0)
    with torch.device("cuda"):
        mlp = Qwen2MLP(config).to(torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return mlp


def variants(mlp: torch.nn.Module) -> dict:
    from actorcore.kernels.quack.gated_mlp import gated_mlp

    def quack(x):
        return gated_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

    return {"transformers eager": mlp.forward, "transformers compiled": torch.compile(mlp.forward),
            "quack gated, eager": quack, "quack gated, compiled": torch.compile(quack)}


def step(forward, x, grad):
    def run():
        xs = x.detach().requires_grad_()
        forward(xs).backward(grad)
        return xs.grad

    return run


def errors(mlp, forward, x, grad) -> tuple[float, float]:
    """Max |Δ| of the output and the input gradient against fp32 math from the same bf16 values, relative."""
    reference = copy.deepcopy(mlp).float()
    xs32 = x.float().requires_grad_()
    want = reference(xs32)
    want.backward(grad.float())
    xs = x.detach().requires_grad_()
    got = forward(xs)
    got.backward(grad)
    rel = [((w - g.float()).abs().max() / w.abs().max()).item() for w, g in ((want, got), (xs32.grad, xs.grad))]
    mlp.zero_grad(set_to_none=True)
    return rel[0], rel[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1536x8960,4096x12288", help="hidden x intermediate, comma-separated")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        hidden, intermediate = map(int, shape.split("x"))
        mlp = build_mlp(hidden, intermediate)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(args.tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
        grad = torch.randn(args.tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
        flops = 6 * 3 * args.tokens * hidden * intermediate
        for name, forward in variants(mlp).items():
            run = step(forward, x, grad)
            for _ in range(2):
                run()
            ms = median_ms(run, args.repeats)  # one more warm-up call, then the median
            per_category, top = kernel_breakdown(run, top=8)
            err_out, err_dx = errors(mlp, forward, x, grad)
            mlp.zero_grad(set_to_none=True)
            row = {"shape": shape, "tokens": args.tokens, "variant": name, "ms": round(ms, 3),
                   "tflops": round(flops / ms / 1e9, 1),
                   "kernels_ms": {k: round(v, 3) for k, v in per_category.items()},
                   "top_kernels": top, "max_rel_err_out": err_out, "max_rel_err_dx": err_dx}
            rows.append(row)
            print(f"{shape} {name:24s} {ms:8.3f} ms {row['tflops']:6.1f} TF/s  err out {err_out:.2e} dx {err_dx:.2e}  "
                  f"{format_breakdown(per_category)}", flush=True)
    write_json(args.out, "gated_mlp.json", {"rows": rows, "torch": torch.__version__})


if __name__ == "__main__":
    main()
