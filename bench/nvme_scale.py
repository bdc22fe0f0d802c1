"""ZeRO-Infinity at scale (issue 14, benchmark 1): one rank trains a GPT
whose model states (16 bytes per parameter) are at least 1.5x this
machine's RAM, with parameters, gradients and optimizer states on NVMe.
Targets: the loss falls and peak RSS stays at or below 8 GiB.

    .venv/bin/python bench/nvme_scale.py [--nvme-path build/bench-nvme-scale]
        [--d-model 2560] [--layers 32] [--steps 3] [--seq 128] [--batch 1]

The GPT (zcore.demo.gpt: vocab 8192, LM head tied) is built on the meta
device and materialised one module at a time by zcore.initialize (stage 3,
bf16, offload_param with max_in_cpu 0 (every shard) and offload_optimizer on
--nvme-path), so it never exists whole in memory. It trains on one fixed
batch of random tokens (memorising it makes the loss fall fast). Per step:
time, loss, bytes read and written through each swap file (parameters,
optimizer states, gradients), and the bandwidth achieved; then fio, in the
same run and directory (libaio, O_DIRECT, 1 MiB blocks, the config's queue
depth), reads and writes a 4 GiB sample each way, giving the disk-bound time
of the step's I/O (read bytes / fio read bandwidth + written bytes / fio
write bandwidth). Peak RSS is the process's VmHWM, restarted before
zcore.initialize. The script re-executes itself with
MALLOC_MMAP_THRESHOLD_=1048576 (see docs/guide/offload-and-nvme.md, start-up).
GB = 1e9 bytes, GiB = 2**30.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MALLOC = "MALLOC_MMAP_THRESHOLD_"
if MALLOC not in os.environ:  # glibc reads it at start-up only
    os.environ[MALLOC] = str(1 << 20)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402 - after the re-exec

import zcore  # noqa: E402
from zcore.demo.gpt import GPT, GPTConfig, _init_weights  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvme_optimizer import Fio, filesystem_of, fio_version, page_cache_dropper  # noqa: E402

VOCAB = 8192
FIO_SAMPLE = 4 << 30  # bytes fio reads and writes to measure the disk
STATE_BYTES = 16  # bf16 parameter and gradient, fp32 master, exp_avg, exp_avg_sq (DeepSpeed's count)


def status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def mem_total() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemTotal")


def swaps(engine) -> dict:
    """The swap files' counters: parameters, optimizer states, gradients."""
    return {
        "parameters": engine.residency.parameter_swap_stats(),
        "optimizer": engine.optimizer.master.swap.stats(),
        "gradients": engine.optimizer.reducer.grads.swap.stats(),
    }


def moved(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    return {k: (after[k].bytes_swapped_in - before[k].bytes_swapped_in,
                after[k].bytes_swapped_out - before[k].bytes_swapped_out) for k in after}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", type=Path, default=ROOT / "build" / "bench-nvme-scale")
    parser.add_argument("--d-model", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-live", type=int, default=400_000_000, help="stage3_max_live_parameters")
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()

    cfg = GPTConfig(vocab_size=VOCAB, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    with torch.device("meta"):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    ram = mem_total()
    print(f"GPT: d_model {args.d_model}, {args.layers} layers, {params / 1e9:.3f}B parameters; model states "
          f"{STATE_BYTES * params / 2**30:.1f} GiB = {STATE_BYTES * params / ram:.2f}x this machine's RAM "
          f"({ram / 2**30:.1f} GiB)")
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    need = (2 + 4 + 12) * params  # bf16 parameters, fp32 gradients, fp32 master and moments on disk
    free = shutil.disk_usage(args.nvme_path).free
    print(f"swap directory {args.nvme_path} ({filesystem_of(args.nvme_path)}): needs {need / 1e9:.1f} GB, "
          f"{free / 1e9:.1f} GB free; fio {fio_version()}; torch threads {torch.get_num_threads()}")
    if free < need * 1.05:
        raise SystemExit("not enough free space for the swap files")

    nvme = {"device": "nvme", "nvme_path": str(args.nvme_path)}
    config = {
        "train_batch_size": args.batch,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        # max_in_cpu 0: every parameter shard on NVMe (the default keeps 1e9 elements in host memory).
        "zero_optimization": {"stage": 3, "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme,
                              "stage3_max_live_parameters": args.max_live},
    }
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    start_rss = status("VmRSS:")
    began = time.perf_counter()
    engine, *_ = zcore.initialize(model=model, config=config, meta_init=zcore.MetaInit(init_fn=_init_weights, seed=0))
    print(f"initialize: {time.perf_counter() - began:.1f} s, peak RSS {status('VmHWM:') / 2**30:.2f} GiB "
          f"(+{(status('VmHWM:') - start_rss) / 2**30:.2f} GiB)")

    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for step in range(args.steps):
        before = swaps(engine)
        began = time.perf_counter()
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - began
        rows.append((step, loss.item(), seconds, moved(before, swaps(engine)), status("VmHWM:")))
        print(f"step {step}: loss {loss.item():.4f}, {seconds:.1f} s", flush=True)
    print(engine.memory_report())
    engine.destroy()

    last = rows[-1][3]
    read = sum(r for r, _ in last.values())
    written = sum(w for _, w in last.values())
    drop, drop_note = page_cache_dropper(True)
    # fio's bandwidth from a sample of each direction (the step's bytes would not fit twice on disk).
    sample = min(FIO_SAMPLE, read), min(FIO_SAMPLE, written)
    fio = Fio(args.nvme_path, *sample, 1 << 20, 8).measure(drop)
    for path in (args.nvme_path / "fio-a.bin", args.nvme_path / "fio-b.bin"):
        path.unlink(missing_ok=True)
    bound = read / fio.read_bps + written / fio.write_bps

    print(f"\n{drop_note}")
    print("| step | loss | step s | read GB (params / optimizer / grads) | written GB (params / optimizer / grads) "
          "| achieved GB/s | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|")
    for step, loss, seconds, io, peak in rows:
        r = " / ".join(f"{io[k][0] / 1e9:.1f}" for k in ("parameters", "optimizer", "gradients"))
        w = " / ".join(f"{io[k][1] / 1e9:.1f}" for k in ("parameters", "optimizer", "gradients"))
        total = sum(a + b for a, b in io.values())
        print(f"| {step} | {loss:.4f} | {seconds:.1f} | {r} | {w} | {total / seconds / 1e9:.2f} | {peak / 2**30:.2f} |")
    print(f"\nfio on {args.nvme_path} ({sample[0] / 2**30:.0f} GiB read, {sample[1] / 2**30:.0f} GiB written): read {fio.read_bps / 1e9:.2f} GB/s, write {fio.write_bps / 1e9:.2f} GB/s, "
          f"both at once {fio.both_read_bps / 1e9:.2f} / {fio.both_write_bps / 1e9:.2f} GB/s")
    print(f"last step: {read / 1e9:.1f} GB read, {written / 1e9:.1f} GB written; disk-bound time {bound:.1f} s "
          f"against {rows[-1][2]:.1f} s measured ({bound / rows[-1][2]:.2f}x)")
    peak = max(r[4] for r in rows)
    falls = rows[-1][1] < rows[0][1]
    print(f"targets: loss falls {rows[0][1]:.3f} -> {rows[-1][1]:.3f} ({'met' if falls else 'NOT met'}); "
          f"peak RSS {peak / 2**30:.2f} GiB <= 8 GiB ({'met' if peak <= 8 * 2**30 else 'NOT met'})")


if __name__ == "__main__":
    main()
