"""``actorcore`` command line: ``demo``, ``verify``, ``convert``, ``models``. Only the CLI package prints. Every sub-command
exits 0 OK, 1 FAIL, 2 bad input (one line on stderr, see ``cli/errors.py``); ``convert`` also 128+N on signal N.

Benchmarks are scripts under ``bench/`` of a source checkout (``python bench/logprob.py --help``); a wheel does
not ship them, so the CLI does not offer them."""

from __future__ import annotations

import argparse
import logging
import sys

from actorcore import __version__
from actorcore.cli.errors import OneLineParser, run_command


def _demo(args: argparse.Namespace) -> int:
    from actorcore.cli.demo import run_demo

    return run_demo(model_path=args.model, seed=args.seed, sp_size=args.sp, device=args.device)


def _verify(args: argparse.Namespace) -> int:
    from actorcore.cli.verify import run_verify

    return run_verify(args)


def _convert(args: argparse.Namespace) -> int:
    from actorcore.cli.convert import main as convert_main

    return convert_main(args.convert_args)


def _models(args: argparse.Namespace) -> int:
    from actorcore.archs.table import models_table

    print(models_table(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="actorcore", description="Exact per-token log-probs for RL on packed batches: the demo on the embedded "
                                      "model, a check of a local model against its own forward, checkpoint "
                                      "conversion, the supported models. Benchmarks: python bench/<name>.py in a source checkout.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"actorcore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="packed vs padded log-probs on a tiny model (or --model PATH)",
                          description="Packed log-probs against the plain padded HF path. Exit 0 OK, 1 FAIL, "
                                      "2 bad input.")
    demo.add_argument("--model", default=None, help="local Hugging Face model directory (default: embedded tiny model)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--sp", type=int, default=2, help="sequence-parallel size for the SP rows (0 to skip)")
    demo.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    demo.set_defaults(func=_demo)

    verify = sub.add_parser("verify", help="check a local model directory: actorcore vs the model's own forward",
                            description="Per-token log-probs and entropies of actorcore against the model's own "
                                        "forward on a seeded random batch. Exit 0 OK, 1 FAIL, 2 bad input.")
    from actorcore.cli.verify import add_arguments

    add_arguments(verify)
    verify.set_defaults(func=_verify)

    convert = sub.add_parser("convert", help="hf-to-mcore / mcore-to-hf checkpoint conversion", add_help=False)
    convert.add_argument("convert_args", nargs=argparse.REMAINDER)
    convert.set_defaults(func=_convert)

    models = sub.add_parser("models", help="the supported-models table (markdown), from the registry")
    models.set_defaults(func=_models)

    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = [a for a in argv if a in ("-v", "--verbose")]
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    if rest[:1] == ["convert"]:
        # argparse's REMAINDER cannot pass a leading option such as --help on: convert parses its own arguments.
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        from actorcore.cli.convert import main as convert_main

        return int(convert_main(rest[1:]) or 0)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
