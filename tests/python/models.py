"""Small models and deterministic data for the training tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        # No bias: the key bias gets an exactly-zero gradient (softmax is shift
        # invariant), and Adam would turn its rounding noise into updates.
        self.attn = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT with the LM head tied to the token embedding."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 2, seq: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


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


MODELS = {"gpt": TinyGPT, "mlp": FrozenMLP, "branch": BranchMLP}


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
    return model(x)


def global_batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    if name == "gpt":
        tokens = torch.randint(0, 64, (size, 17), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(size, 16, generator=gen)
    return x, torch.randn(size, 4, generator=gen)


def loss_of(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output.float(), target)
