"""The ``zcore`` command."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def demo(args: argparse.Namespace, rest: list[str]) -> int:
    """Starts the demo's ranks through torch's own launcher."""
    nproc = args.nproc if args.nproc is not None else min(2, runnable_ranks()[0])
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "zcore.demo.train", *rest,
    ]
    return subprocess.call(command)


def runnable_ranks() -> tuple[int, str]:
    """How many local ranks this machine runs, and why: one per GPU where
    CUDA is usable (the ranks take NCCL, one device each), else one per
    CPU this process may use (gloo ranks)."""
    import torch

    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        return gpus, f"one per GPU, and it has {gpus}"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus, f"one per CPU without a GPU, and this process may use {cpus}"


def local_ranks(minimum: int):
    """An argparse type: a number of local ranks to start, ``minimum`` or
    more and no more than the machine runs (``runnable_ranks``): checked
    before torch's launcher, which would fail with a bare AssertionError."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of processes") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} processes: this starts at least {minimum}")
        most, why = runnable_ranks()
        if value > most:
            raise argparse.ArgumentTypeError(f"{value} processes: this machine runs at most {most} ({why})")
        return value

    return parse


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
    from zcore.errors import ZcoreError

    try:
        files = write(
            args.checkpoint,
            args.output,
            tag=args.tag,
            dtype=getattr(torch, _DTYPES[args.dtype]),
            max_shard_bytes=args.max_shard_size,
        )
    except (ZcoreError, OSError) as exc:  # a bad checkpoint or output directory: the message says which
        print(f"zcore consolidate: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    return 0


def convert(args: argparse.Namespace) -> int:
    from zcore.checkpoint.deepspeed_convert import convert_deepspeed_checkpoint
    from zcore.errors import ZcoreError

    try:
        tag_dir = convert_deepspeed_checkpoint(args.source, args.destination, tag=args.tag)
    except (ZcoreError, OSError) as exc:  # a bad checkpoint or output directory: the message says which
        print(f"zcore convert: {exc}", file=sys.stderr)
        return 1
    print(tag_dir)
    return 0


def plot(args: argparse.Namespace) -> int:
    from zcore.errors import InvalidArgumentError
    from zcore.observe.plot import write_plots

    try:
        paths = write_plots(args.run_dir, args.output)
    except (InvalidArgumentError, ModuleNotFoundError) as exc:  # a bad directory, or no matplotlib
        print(exc, file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def at_least(minimum: int):
    """An argparse type: a whole number, ``minimum`` or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


def bench_comm(args: argparse.Namespace) -> int:
    """Under a launcher (RANK and WORLD_SIZE set), this process is one rank
    of the measurement; otherwise it starts ``--nproc`` local ranks of this
    same command through torch's launcher."""
    if args.min_size > args.max_size:
        print(f"zcore bench-comm: --min-size ({args.min_size} bytes) is larger than --max-size "
              f"({args.max_size} bytes)", file=sys.stderr)
        return 2
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return subprocess.call([
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            "-m", "zcore.cli", "bench-comm", f"--min-size={args.min_size}", f"--max-size={args.max_size}",
            f"--dtype={args.dtype}", f"--iters={args.iters}", f"--warmup={args.warmup}",
        ])
    import torch

    from zcore.observe.comm_bench import run
    from zcore.demo.train import exit_now

    run(args.min_size, args.max_size, getattr(torch, _DTYPES[args.dtype]), args.iters, args.warmup)
    exit_now()  # no interpreter teardown, where gloo may abort (see there)


def estimate(args: argparse.Namespace) -> int:
    """Per-rank memory of each stage and offload choice, and the cheapest that fits the budgets."""
    import json

    import torch

    from zcore.config.schema import load_config
    from zcore.errors import ZcoreError
    from zcore.plan.estimate import Planner
    from zcore.plan.recommend import Budget, choices, recommend

    if (args.device_memory is None) != (args.host_memory is None):
        print("zcore estimate: give both --device-memory and --host-memory for a recommendation, or neither",
              file=sys.stderr)
        return 2
    split = args.tp * args.pp
    if split > 1 and args.params is None:
        print("zcore estimate: --tp and --pp split --params evenly; for a model, estimate the part one rank "
              "holds (a pipeline stage, a tensor-parallel rank's module) with "
              "zcore.estimate_memory(module, config, data_parallel_size)", file=sys.stderr)
        return 2
    if split > 1 and args.seq_len is not None:
        print("zcore estimate: --seq-len with --params runs a GPT-like shape of the whole count, but with --tp and "
              "--pp a rank holds a part of the model: give one rank's activations with --activations instead",
              file=sys.stderr)
        return 2
    try:
        config = load_config(args.config if args.config is not None else {})
        model = args.params if args.params is not None else model_from_spec(args.model)
        if split > 1:
            model = -(-model // split)
            print(f"{args.params} parameters split evenly over {args.tp} tensor-parallel x {args.pp} pipeline "
                  f"ranks: {model} per rank, sharded over {args.world_size} data-parallel ranks\n")
        sample = None
        if args.seq_len is not None:  # token ids, the first input of language models (and of --params' shape)
            micro = config.train_micro_batch_size_per_gpu
            batch = args.batch or (micro if isinstance(micro, int) else 1)
            sample = torch.zeros(batch, args.seq_len, dtype=torch.long, device="meta")
        planner = Planner(model, config, device=args.device, sample_input=sample,
                          activations=args.activations, host_available=args.host_memory)
        for choice in choices(planner, args.world_size, args.nvme_path):
            print(f"{choice}\n")
        if args.device_memory is not None:
            budget = Budget(args.device_memory, args.host_memory, args.nvme_memory, args.ranks_per_node)
            chosen = recommend(planner, args.world_size, budget, args.nvme_path)
            print(chosen)
            print(json.dumps({"zero_optimization": chosen.zero_optimization}, indent=2))
    except (ZcoreError, ValueError, OSError, ImportError, AttributeError) as exc:
        print(f"zcore estimate: {exc}", file=sys.stderr)
        return 1
    return 0


def model_from_spec(spec: str):
    """``hf:<name or directory>``: a transformers model built from its
    config (a causal LM where the config names one); ``module:callable``
    (importable from the working directory): what the callable returns.
    Either is built on the meta device, so no weight is allocated."""
    import importlib

    import torch

    from zcore.errors import InvalidArgumentError

    if spec.startswith("hf:"):
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(spec[len("hf:"):])
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(hf_config)
            except ValueError:  # no causal LM for this config type
                return AutoModel.from_config(hf_config)
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidArgumentError(
            f"--model {spec!r} is neither hf:<name or directory> nor module:callable (e.g. mypkg.models:build)"
        )
    if os.getcwd() not in sys.path:  # as python -m does
        sys.path.insert(0, os.getcwd())
    build = importlib.import_module(module_name)
    for name in attribute.split("."):
        build = getattr(build, name)
    with torch.device("meta"):
        model = build()
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"--model {spec}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parameter_count(text: str) -> int:
    """An argparse type: '1.3B', '350M', '125k', '7e9' or a plain number of parameters."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmbt]?)\s*", text, re.IGNORECASE)
    count = int(float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]) if match else 0
    if count <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count such as 1.3B, 350M or 125000")
    return count


def _add_estimate_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "estimate",
        help="per-rank device, host and NVMe memory of each ZeRO stage and offload choice, and the "
             "cheapest that fits --device-memory and --host-memory",
    )
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parameter_count,
                      help="a parameter count, e.g. 1.3B or 350M (all trained; with --seq-len, activations of a "
                           "GPT-like shape assumed from it, printed)")
    what.add_argument("--model", help="hf:<name or local directory> (built from its config on the meta device), "
                                      "or module:callable returning a torch.nn.Module")
    plan.add_argument("--config", default=None, help="DeepSpeed-style JSON config (default: none, so fp32): "
                                                     "its keys other than the stage and offload devices are kept")
    plan.add_argument("--world-size", type=at_least(1), default=1, help="data-parallel ranks (default 1)")
    plan.add_argument("--tp", type=at_least(1), default=1,
                      help="tensor-parallel ranks that split --params evenly beside the data-parallel ones (default 1)")
    plan.add_argument("--pp", type=at_least(1), default=1,
                      help="pipeline stages that split --params evenly beside the data-parallel ones (default 1)")
    plan.add_argument("--device-memory", type=size_argument, help="memory of one device, e.g. 80GiB")
    plan.add_argument("--host-memory", type=size_argument, help="host memory of one node, e.g. 512GiB")
    plan.add_argument("--nvme-memory", type=size_argument, default=None,
                      help="free NVMe space of one node (default: not checked)")
    plan.add_argument("--nvme-path", default=None,
                      help="directory for NVMe choices (default: the config's; without one they are skipped)")
    plan.add_argument("--ranks-per-node", type=at_least(1), default=1,
                      help="ranks sharing a node's host memory and NVMe (default 1)")
    plan.add_argument("--batch", type=at_least(1), default=None,
                      help="micro-batch for the activations (default: the config's, or 1)")
    plan.add_argument("--seq-len", type=at_least(1), default=None,
                      help="tokens per sample: activations measured with one forward on the meta device "
                           "(needed for a recommendation, unless --activations is given)")
    plan.add_argument("--activations", type=size_argument, default=None,
                      help="activation bytes per rank, when known otherwise (e.g. 6GiB)")
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="compute device (default cuda)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zcore", description="zcore: ZeRO memory engine for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_help = (
        "train a small GPT with ZeRO-3 on local ranks (extra options: --steps N, --micro-batch N, "
        "--nvme PATH: parameters and optimizer states on NVMe under PATH, --metrics DIR: every step's "
        "metrics as CSV files for zcore plot)"
    )
    demo_parser = commands.add_parser("demo", help=demo_help, description=demo_help)
    demo_parser.add_argument("--nproc", type=local_ranks(1), default=None,
                             help="local ranks, at most one per GPU, or per CPU without one (default 2, or 1 "
                                  "where the machine runs one)")
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
    converting = commands.add_parser(
        "convert",
        help="write a DeepSpeed ZeRO checkpoint as a zcore checkpoint (loadable at any world size), one "
             "rank file at a time",
    )
    converting.add_argument("--from", dest="source_format", choices=["deepspeed"], required=True,
                            help="the format of SRC: deepspeed (a directory DeepSpeed's save_checkpoint wrote)")
    converting.add_argument("source", metavar="SRC", help="the directory given to DeepSpeed's save_checkpoint")
    converting.add_argument("destination", metavar="DST", help="the directory for the zcore checkpoint")
    converting.add_argument("--tag", default=None, help="tag to convert (default: the one in SRC/latest)")
    pictures = commands.add_parser(
        "plot",
        help="draw PNGs of a csv_monitor run: loss and learning rate, throughput, step-time split, memory",
    )
    pictures.add_argument("run_dir", metavar="RUN_DIR",
                           help="csv_monitor's output_path/job_name (or output_path holding one job)")
    pictures.add_argument("--output", default=None, help="directory for the PNGs (default: RUN_DIR)")
    bench = commands.add_parser(
        "bench-comm",
        help="measure all-gather and reduce-scatter bandwidth by message size; report the bucket size "
             "at 90%% of peak",
    )
    bench.add_argument("--nproc", type=local_ranks(2), default=2,
                       help="local ranks to start (default 2; ignored under torchrun, which sets the ranks)")
    # Not --min/--max: torch's launcher would take --max for its own --max-restarts.
    bench.add_argument("--min-size", type=size_argument, default=64 * 2**10,
                       help="smallest message, the whole buffer, e.g. 64KiB (default)")
    bench.add_argument("--max-size", type=size_argument, default=256 * 2**20,
                       help="largest message, e.g. 256MiB (default); sizes double from --min-size")
    bench.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                       help="element type, for bucket sizes in elements: your compute dtype (default fp32)")
    bench.add_argument("--iters", type=at_least(1), default=20, help="timed calls per size (default 20)")
    bench.add_argument("--warmup", type=at_least(0), default=5, help="untimed calls first (default 5)")
    _add_estimate_parser(commands)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        return demo(args, rest)  # the demo's own options pass through
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return _COMMANDS[args.command](args)


# The subcommands other than the demo, by name.
_COMMANDS = {"consolidate": consolidate, "convert": convert, "plot": plot, "bench-comm": bench_comm, "estimate": estimate}

if __name__ == "__main__":
    sys.exit(main())
