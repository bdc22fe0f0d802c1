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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcore", description="zcore: ZeRO memory engine for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="train a small GPT with ZeRO-3 on local ranks (extra options: --steps, --micro-batch)"
    )
    demo_parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    args, rest = parser.parse_known_args(argv)
    return demo(args, rest)


if __name__ == "__main__":
    sys.exit(main())
