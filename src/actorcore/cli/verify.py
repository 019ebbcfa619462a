"""``actorcore verify MODEL_DIR``: actorcore's per-token outputs against the model's own forward (it prints).

Loads a local Hugging Face model directory (never the hub), scores a seeded batch of random token ids with
``actorcore.verify`` and prints one table. Exit code 0: OK; 1: a difference beyond the tolerance; 2: bad input
(missing directory, unreadable model, unsupported architecture, bad arguments). A VLM directory is checked on
a text-only batch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from actorcore.cli.errors import EXIT_FAIL, EXIT_OK, EXIT_USER_ERROR, first_line, is_user_error
from actorcore.errors import CheckpointError
from actorcore.model_files import check_model_dir

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face model directory (config + weights)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype to load the model in")
    parser.add_argument("--seq-lens", default="7,13,31", help="comma-separated sequence lengths of the batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    parser.add_argument("--temperature", type=float, default=1.0, help="logits are divided by this")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest accepted per-token |Δ| (default: the table entry for --dtype)")


def _seq_lens(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seq-lens {text!r}: expected comma-separated integers such as 7,13,31") from None
    if not lens or min(lens) < 2:
        raise ValueError(f"--seq-lens {text!r}: give at least one length, each >= 2 (the first token is not scored)")
    return lens


def _load(model_dir: str, dtype_name: str, device: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    check_model_dir(model_dir)  # inside the directory, readable: a damaged file is one line, not a traceback
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model_dir}: cannot read a Hugging Face config ({first_line(exc)})") from None
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(model_dir, local_files_only=True, dtype=getattr(torch, dtype_name))
    except Exception as exc:  # noqa: BLE001 - transformers' loading errors of a local directory are its content's
        raise CheckpointError(f"{model_dir}: transformers could not load the model ({type(exc).__name__}: "
                              f"{first_line(exc)})") from exc
    return model.to(device).eval()


def _batch(model: Any, lens: list[int], seed: int, device: str) -> Any:
    """Random ids in [0, vocab), seeded; a VLM gets a text-only batch without its image/video placeholder ids."""
    import torch

    import actorcore as ac

    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    if not hasattr(model.config, "vision_config"):
        return ac.pack(sequences).to(device)
    placeholders = torch.tensor([int(getattr(model.config, f)) for f in ("image_token_id", "video_token_id")
                                 if getattr(model.config, f, None) is not None])
    text = torch.tensor([i for i in range(vocab) if i not in set(placeholders.tolist())])
    sequences = [text[s % len(text)] for s in sequences]
    return ac.pack([s.to(device) for s in sequences], model=model)


def run_verify(args: argparse.Namespace) -> int:
    import torch

    import actorcore as ac

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here; use --device cpu")
        if args.temperature <= 0:
            raise ValueError(f"--temperature must be positive, got {args.temperature}")
        lens = _seq_lens(args.seq_lens)
        model = _load(args.model_dir, args.dtype, device)
        report = ac.verify(model, _batch(model, lens, args.seed, device), temperature=args.temperature,
                           tolerance=args.tolerance)
    except BaseException as exc:  # noqa: BLE001 - bad input is one line and exit 2; bugs keep their traceback
        if not is_user_error(exc):
            raise
        print(f"error: {first_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    where = "at (sequence, position)"
    rows = [
        ("model", f"{args.model_dir} ({report.model_type}, {report.dtype}, {device})"),
        ("tokens compared", f"{report.tokens} in {report.sequences} sequences of lengths {lens}"),
        ("max |Δ log-prob|", f"{report.max_abs_diff_logprob:.2e} {where} {report.worst_logprob_token}"),
        ("max |Δ entropy|", f"{report.max_abs_diff_entropy:.2e} {where} {report.worst_entropy_token}"),
        ("tolerance", f"{report.tolerance:.1e} per token"),
    ]
    print("actorcore compute_logprobs vs the model's own forward, one sequence at a time "
          f"(temperature {report.temperature:g})")
    for name, value in rows:
        print(f"  {name:<17} {value}")
    print("OK" if report.ok else "FAIL: actorcore differs from the model's own forward beyond the tolerance; "
          "the arch spec may miss a head transform or config field of this model")
    return EXIT_OK if report.ok else EXIT_FAIL
