"""zcore demonstration: what the native core does today.

1. Trains a small MLP whose parameters live as typed views inside one
   zcore arena of native host memory, within a byte budget.
2. Replays a ZeRO-3-like gather/release churn of layer-sized buffers in that
   arena, showing fragmentation and the compaction that cures it, with the
   trained parameters intact throughout.

Later issues turn this into ZeRO-3 training on two ranks.
"""

from __future__ import annotations

import argparse

import torch

import zcore


def build_model(arena: zcore.Arena, sizes: list[int]) -> list[tuple[zcore.Block, zcore.Block]]:
    layers = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        weight = arena.allocate((fan_out, fan_in), torch.float32)
        bias = arena.allocate((fan_out,), torch.float32)
        torch.nn.init.kaiming_uniform_(arena.tensor(weight), a=5**0.5)
        arena.tensor(bias).zero_()
        layers.append((weight, bias))
    return layers


def forward(arena: zcore.Arena, layers, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = []
    for i, (weight, bias) in enumerate(layers):
        w = arena.tensor(weight).requires_grad_()
        b = arena.tensor(bias).requires_grad_()
        params += [w, b]
        x = torch.nn.functional.linear(x, w, b)
        if i < len(layers) - 1:
            x = torch.relu(x)
    return x, params


def train(arena: zcore.Arena, layers, steps: int, lr: float) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 64, generator=gen)
    targets = torch.sin(inputs @ torch.randn(64, 8, generator=gen))
    for step in range(steps):
        out, params = forward(arena, layers, inputs)
        loss = torch.nn.functional.mse_loss(out, targets)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)  # updates the arena's bytes in place
        if step % 25 == 0 or step == steps - 1:
            print(f"  step {step:3d}  loss {loss.item():.4f}")


def churn(arena: zcore.Arena, rounds: int) -> None:
    """Gather/release layer-sized buffers of varied sizes, as ZeRO-3 does."""
    gen = torch.Generator().manual_seed(1)
    live: list[zcore.Block] = []
    for _ in range(rounds):
        n = int(torch.randint(20_000, 140_000, (1,), generator=gen))
        try:
            live.append(arena.allocate((n,), torch.bfloat16))
        except zcore.OutOfArenaError:
            pass  # more live bytes than the arena holds: the next release makes room
        if len(live) > 6:
            arena.free(live.pop(int(torch.randint(0, len(live), (1,), generator=gen))))
    for block in live[::2]:
        arena.free(block)


def report(arena: zcore.Arena, title: str) -> None:
    s = arena.stats()
    print(
        f"  {title}: used {s.used / 2**20:.2f} MiB of {s.capacity / 2**20:.0f} MiB, "
        f"largest free {s.largest_free / 2**20:.2f} MiB, fragmentation {s.fragmentation:.2f}, "
        f"live blocks {s.live_blocks}, compactions {s.defragmentations}, "
        f"moved {s.bytes_moved / 2**20:.2f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--arena-mib", type=int, default=2)
    args = parser.parse_args()

    print(f"zcore {zcore.build_info()}")
    if not zcore.cuda_available():
        print(f"  CUDA: {zcore.cuda_unavailable_reason()}")

    memory = zcore.HostMemory(budget=args.arena_mib << 20, lock="try")
    arena = zcore.Arena.on_host(args.arena_mib << 20, memory=memory)
    layers = build_model(arena, [64, 256, 256, 8])
    report(arena, "model in arena")

    print("training (parameters are views into the arena):")
    train(arena, layers, args.steps, lr=0.2)
    snapshot = [arena.tensor(b).clone() for pair in layers for b in pair]

    print("gather/release churn in the same arena:")
    churn(arena, rounds=400)
    report(arena, "after churn")
    arena.defragment()
    report(arena, "after defragment")
    intact = all(
        torch.equal(arena.tensor(b), s) for b, s in zip((b for p in layers for b in p), snapshot)
    )
    print(f"  trained parameters intact after {arena.generation} compactions: {intact}")

    try:
        memory.zeros((1 << 20,), torch.float32)
    except zcore.HostMemoryBudgetError as exc:
        print(f"  a request beyond the host budget is refused: {exc}")


if __name__ == "__main__":
    main()
