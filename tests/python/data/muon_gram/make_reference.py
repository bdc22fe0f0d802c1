"""Writes reference.pt, what DeepSpeed's Gram Newton-Schulz and its Muon
step with ns_method "gram" give, for test_muon_gram to hold zcore's against.

Run it where DeepSpeed 0.19.8 is installed (on the CPU: no compiled ops),
from the repository root, outside zcore's environment:

    python3 -m venv /tmp/venv-ds && /tmp/venv-ds/bin/pip install torch==2.13.0 numpy
    DS_BUILD_OPS=0 /tmp/venv-ds/bin/pip install deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/venv-ds/bin/python tests/python/data/muon_gram/make_reference.py

On a tall, a wide and a square fp32 matrix, and a 3-D parameter (which
DeepSpeed's Muon orthogonalises as a batch of matrices): the iteration's
output (zeropower_via_gram_newtonschulz, 5 steps; fp16 where the CPU has
fp16 matmuls, as ns_compute_dtype says), and the parameters after each of
two steps of DeepSpeed's SingleDeviceMuon from stored parameters and
gradients. (A 4-D parameter fails in DeepSpeed 0.19.8's muon_update: its
final torch.where broadcasts the 2-D update against the 4-D gradient.)
Each twice: "compiled", as DeepSpeed ships them (under torch.compile), and
"eager", the same functions with torch.compile disabled, whose operations
are those written in the source, one rounding each. A probe (an fp16 matmul
and an fp32 norm) lets the test tell whether its CPU rounds those as this
one did.
"""

from __future__ import annotations

from pathlib import Path

import torch
from deepspeed.runtime.zero.muon.original_muon import (
    SingleDeviceMuon, ns_compute_dtype, zeropower_via_gram_newtonschulz,
)

SHAPES = {"tall": (64, 16), "wide": (24, 72), "square": (32, 32), "batch": (3, 12, 40)}
NS_STEPS = 5
HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
STEPS = 2
OUT = Path(__file__).with_name("reference.pt")


def _muon_steps(params: dict, grads: dict) -> dict:
    weights = {name: torch.nn.Parameter(p.clone()) for name, p in params.items()}
    optimizer = SingleDeviceMuon(list(weights.values()), ns_method="gram", **HYPER)
    after = {}
    for step in range(1, STEPS + 1):
        for name, w in weights.items():
            w.grad = grads[name][step - 1].clone()  # muon_update blends into the gradient in place
        optimizer.step()
        after.update({f"{name}/step{step}": w.detach().clone() for name, w in weights.items()})
    return after


def _run(params: dict, grads: dict, mode: str) -> dict:
    out = {f"{name}/gram": zeropower_via_gram_newtonschulz(g[0].clone(), steps=NS_STEPS) for name, g in grads.items()}
    out.update(_muon_steps(params, grads))
    return {f"{key}/{mode}": value for key, value in out.items()}


def main() -> None:
    gen = torch.Generator().manual_seed(38)
    params = {name: torch.randn(shape, generator=gen) * 0.05 for name, shape in SHAPES.items()}
    grads = {name: [torch.randn(shape, generator=gen) for _ in range(STEPS)] for name, shape in SHAPES.items()}
    probe_a = torch.randn(64, 48, generator=gen).half()
    probe_b = torch.randn(48, 64, generator=gen).half()
    probe_x = torch.randn(100, 37, generator=gen)
    record = {
        "probe/a": probe_a, "probe/b": probe_b, "probe/product": probe_a @ probe_b,
        "probe/x": probe_x, "probe/norm": probe_x.norm(dim=(-2, -1), keepdim=True),
        "compute_dtype": torch.empty(0, dtype=ns_compute_dtype("gram")),
        "ns_steps": torch.tensor(NS_STEPS),
        **{f"hyper/{k}": torch.tensor(v, dtype=torch.float64) for k, v in HYPER.items()},
    }
    for name in SHAPES:
        record[f"{name}/param"] = params[name]
        record.update({f"{name}/grad{step + 1}": g for step, g in enumerate(grads[name])})
    record.update(_run(params, grads, "compiled"))
    with torch.compiler.set_stance("force_eager"):
        record.update(_run(params, grads, "eager"))
    torch.save(record, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, compute dtype {ns_compute_dtype('gram')})")


if __name__ == "__main__":
    main()
