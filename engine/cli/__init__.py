"""The `engine` command line. The CLI owns the console: library code logs, this package prints.

One module per command: ``train``, ``convert``, ``eval`` here, ``export``/``predict`` in
``engine.export.cli``."""
from __future__ import annotations

import argparse
import os
import sys

# OpenBLAS's worker threads busy-wait about 2^28 cycles (~0.1 s) after every call before they sleep.
# The engine alternates BLAS products with Numba kernels (predict: hash lookup + pooling between
# forward passes) and runs several processes on one machine, so a spinning BLAS thread steals a core
# from them (measured: the predictor's fused lookup ran 2x slower right after a matmul). 2^4 cycles
# unless the environment says otherwise; it must be set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from ..export import cli as export_cli
from . import certs as certs_cmd, convert as convert_cmd, eval as eval_cmd, train as train_cmd
from . import k8s as k8s_cmd
from . import plan as plan_cmd
from . import status as status_cmd


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine", description="Train sparse recommender models (CTR-DNN, DeepFM, Word2Vec) on parameter "
        "servers, and export, serve, evaluate and watch them. 'engine COMMAND --help' describes each command.")
    sub = parser.add_subparsers(dest="command", required=True)
    train_cmd.add_parser(sub)
    convert_cmd.add_parser(sub)
    eval_cmd.add_parser(sub)
    export_cli.add_subparsers(sub)
    certs_cmd.add_parser(sub)
    k8s_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    status_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "train":
        return train_cmd.run(args)
    if args.command == "convert":
        return convert_cmd.run(args)
    if args.command == "eval":
        return eval_cmd.run(args)
    if args.command == "certs":
        return certs_cmd.run(args)
    if args.command == "k8s":
        return k8s_cmd.run(args)
    if args.command == "plan":
        return plan_cmd.run(args)
    if args.command == "status":
        return status_cmd.run(args)
    if args.command in ("export", "predict"):
        return export_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
