"""The `engine` command line. The CLI owns the console: library code logs, this module prints."""
from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "train":
        print("engine train: the training job is not built yet (see the open issues)", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
