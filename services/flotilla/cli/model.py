"""`flotilla model ...`: make model checkpoints for tests and local runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flotilla.models.checkpoint import ARCHITECTURES, DTYPES, SIZES, write_checkpoint

EXIT_USAGE = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="make and inspect model checkpoints")
    commands = model.add_subparsers(dest="model_command", required=True)
    init = commands.add_parser("init", help="write a random-weight Hugging Face checkpoint")
    init.add_argument("dir", type=Path, help="output directory")
    init.add_argument("--size", choices=sorted(SIZES), default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    init.add_argument("--dtype", choices=DTYPES, default="float32")
    init.add_argument("--force", action="store_true", help="write into a non-empty directory")
    init.set_defaults(func=run_init)


def run_init(args: argparse.Namespace) -> int:
    out_dir: Path = args.dir
    if out_dir.exists() and not out_dir.is_dir():
        print(f"flotilla model init: {out_dir} exists and is not a directory", file=sys.stderr)
        return EXIT_USAGE
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.force:
        print(f"flotilla model init: {out_dir} is not empty; pass --force to write into it anyway",
              file=sys.stderr)
        return EXIT_USAGE
    if args.seed < 0:
        print("flotilla model init: --seed must be non-negative", file=sys.stderr)
        return EXIT_USAGE
    path = write_checkpoint(out_dir, size=args.size, seed=args.seed, architecture=args.arch, dtype=args.dtype)
    print(f"wrote {args.size} {args.arch} checkpoint (seed {args.seed}, {args.dtype}) to {path}")
    return 0
