"""The ``zcore`` command."""

from __future__ import annotations

import argparse
import subprocess
import sys


def demo(args: argparse.Namespace, rest: list[str]) -> int:
    """Starts the demo's ranks through torch's own launcher."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={args.nproc}", "-m", "zcore.demo.train", *rest,
    ]
    return subprocess.call(command)


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def size_argument(text: str) -> int:
    from zcore.checkpoint.files import size_in_bytes

    try:
        return size_in_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def consolidate(args: argparse.Namespace) -> int:
    import torch

    from zcore.checkpoint import consolidate as write

    files = write(
        args.checkpoint,
        args.output,
        tag=args.tag,
        dtype=getattr(torch, _DTYPES[args.dtype]),
        max_shard_bytes=args.max_shard_size,
    )
    for path in files:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcore", description="zcore: ZeRO memory engine for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_help = (
        "train a small GPT with ZeRO-3 on local ranks (extra options: --steps N, --micro-batch N, "
        "--nvme PATH: parameters and optimizer states on NVMe under PATH)"
    )
    demo_parser = commands.add_parser("demo", help=demo_help, description=demo_help)
    demo_parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    merge = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one state dict (safetensors), streaming tensor by tensor",
    )
    merge.add_argument("checkpoint", help="the directory given to engine.save_checkpoint")
    merge.add_argument("output", help="directory for model.safetensors (or its split files and index)")
    merge.add_argument("--tag", default=None, help="tag to consolidate (default: the one in 'latest')")
    merge.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="floating-point dtype (default fp32)")
    merge.add_argument("--max-shard-size", type=size_argument, default=5 * 2**30,
                       help="largest output file, e.g. 5GB or 2GiB (default 5GiB)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "consolidate":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return consolidate(args)
    return demo(args, rest)


if __name__ == "__main__":
    sys.exit(main())
