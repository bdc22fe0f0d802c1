"""Small models and deterministic data for the training tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zcore

from zcore.demo.gpt import GPT, GPTConfig


def TinyGPT(**options) -> nn.Module:
    """zcore's demo GPT, tiny; its LM head is tied to the token embedding.
    ``options``: more GPTConfig fields (activation checkpointing)."""
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, **options))


def wide_mlp() -> nn.Module:
    """153k parameters, each tensor under 1 MiB: large enough that each
    memory category is many allocator blocks of 512 bytes (the memory tests)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(200, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 10))


class FrozenMLP(nn.Module):
    """An MLP whose first layer is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 32)
        self.hidden = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(torch.tanh(self.frozen(x)))))


class BranchMLP(nn.Module):
    """An MLP with a branch taken only on some calls: its parameters get no
    gradient on the ranks (or steps) that skip it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class MixedUse(nn.Module):
    """ZeRO-3's structural cases in one model: a layer called twice per
    forward, a frozen submodule, a branch taken on some steps only (on every
    rank alike: ranks whose modules differ cannot share all-gathers), and a
    parameter used outside its module (the head's, in this forward),
    declared to zcore."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.shared = nn.Linear(32, 32)
        self.frozen = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        zcore.register_external_parameter(self, self.head.weight)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        h = torch.tanh(self.shared(self.frozen(h)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h) + 0.1 * F.linear(h, self.head.weight)


class NormMLP(nn.Module):
    """Buffers that change as it trains (batch norm's running statistics,
    an int64 counter among them) and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(torch.tanh(self.norm(self.inp(x))))))


class LearnedQueries(nn.Module):
    """Returns its parameter, as learned query or position tables do."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.5 * torch.randn(n, d))

    def forward(self) -> torch.Tensor:
        return self.weight


class TransposedWeight(nn.Linear):
    """Returns a view of its weight (its transpose) instead of applying it."""

    def forward(self) -> torch.Tensor:
        return self.weight.t()


class Mixer(nn.Module):
    """Applies a weight that its child returns, then its own scale."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.proj = TransposedWeight(d, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.proj()) * self.scale


class ReturnedParams(nn.Module):
    """Parameters used outside their module, handed over by return values
    and declared to zcore nowhere: a child returns its parameter to the
    model (which has no parameters of its own), another returns a view of
    its weight to a parent with parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = LearnedQueries(4, 16)
        self.inp = nn.Linear(16, 16)
        self.mixer = Mixer(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x) + self.queries().mean(0))
        return self.head(torch.tanh(self.mixer(h)))


class SideInputs(nn.Module):
    """Two modules whose inputs take no gradient, side by side: a token
    embedding (of a token read off the features) and a projection of the
    raw features, both larger than the rest of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 128)
        self.side = nn.Linear(16, 128)
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x.argmax(dim=-1)) + self.side(x)
        return self.head(torch.tanh(h))


class PaddedLayer(nn.Module):
    """A 16-wide layer whose group holds ``extra`` more elements: a vector of
    which only the first 16 entries are used, to give groups chosen sizes."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.25 * torch.randn(16, 16))
        self.extra = nn.Parameter(torch.zeros(extra))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight + self.extra[:16])


class Revisits(nn.Module):
    """Layers of mixed group sizes, some run twice a forward: with prefetch
    and reuse distance, groups are gathered and released out of order, and
    the ZeRO-3 arena fragments until it must compact (found by a search
    over sizes, orders and budgets; see test_zero3_compaction)."""

    SIZES = (3000, 600, 600, 1500, 600, 3000)
    ORDER = (5, 2, 5, 0, 1, 2, 3, 4)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PaddedLayer(n) for n in self.SIZES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.ORDER:
            x = self.layers[i](x)
        return x[:, :4]


class EmptyPrefix(nn.Module):
    """A prefix table configured with no rows: its only parameter has no
    elements, so its ZeRO-3 group holds nothing but padding."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(0, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.table.sum(0)


class EmptyTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.prefix = EmptyPrefix(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.prefix(torch.tanh(self.inp(x))))


MODELS = {
    "gpt": TinyGPT,
    # The same weights, each block under torch.utils.checkpoint.
    "gpt_checkpointed": lambda: TinyGPT(checkpoint_blocks=True),
    "gpt_checkpointed_reentrant": lambda: TinyGPT(checkpoint_blocks=True, reentrant=True),
    "mlp": FrozenMLP,
    "branch": BranchMLP,
    "mix": MixedUse,
    "returned": ReturnedParams,
    "side": SideInputs,
    "revisits": Revisits,
    "norm": NormMLP,
    "empty": EmptyTable,
}


def make_model(name: str) -> nn.Module:
    torch.manual_seed(1234)
    return MODELS[name]()


def takes_branch(step: int, rank: int) -> bool:
    """Branch schedule: with one rank, skipped on every other step (unused
    everywhere); with several, used by some ranks on each step."""
    return (step + rank) % 2 == 0


def forward(name: str, model: nn.Module, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    if name == "branch":
        return model(x, use_branch=takes_branch(step, rank))
    if name == "mix":
        return model(x, use_branch=step % 3 == 0)
    return model(x)


def takes_tokens(name: str) -> bool:
    return name.startswith("gpt")


def global_batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    if takes_tokens(name):
        tokens = torch.randint(0, 64, (size, 17), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(size, 16, generator=gen)
    return x, torch.randn(size, 4, generator=gen)


def loss_of(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if takes_tokens(name):
        return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output.float(), target)
