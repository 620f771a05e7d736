"""The `engine` command line. The CLI owns the console: library code logs, this module prints."""
from __future__ import annotations

import argparse
import sys

from . import convert_cmd, eval_cmd, train_cmd
from .export import cli as export_cli


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train_cmd.add_parser(sub)
    convert_cmd.add_parser(sub)
    eval_cmd.add_parser(sub)
    export_cli.add_subparsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "train":
        return train_cmd.run(args)
    if args.command == "convert":
        return convert_cmd.run(args)
    if args.command == "eval":
        return eval_cmd.run(args)
    if args.command in ("export", "predict"):
        return export_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
