"""A GPT-like model assumed from a bare parameter count, so that its
activations can be measured (zcore.plan.estimate, a count with token ids):
GPT-2's layout and operations (its GELU written out, dropout 0.1, no
key-value cache), with GPT-3's depth for the nearest of its sizes and the
width that makes up the count. Only shapes matter: it is built and run on
the meta device."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCABULARY = 50257  # GPT-2's
HEAD_SIZE = 64  # GPT-2's
WIDTH_STEP = 128  # widths are multiples of this
DROPOUT = 0.1  # GPT-2's resid_pdrop, embd_pdrop and attn_pdrop
# GPT-3's models (Brown et al. 2020, table 2.1): parameters, layers.
GPT3_DEPTHS = ((125e6, 12), (350e6, 24), (760e6, 24), (1.3e9, 24), (2.7e9, 32), (6.7e9, 32), (13e9, 40), (175e9, 96))


@dataclass(frozen=True)
class GPTShape:
    layers: int
    width: int
    positions: int  # learned, one per token of the sample

    @staticmethod
    def of(count: int, positions: int) -> GPTShape:
        """The depth of GPT-3's model nearest ``count`` (by ratio), and the
        width (a multiple of WIDTH_STEP) whose count, positions aside, is nearest."""
        _, layers = min(GPT3_DEPTHS, key=lambda row: abs(math.log(count / row[0])))
        widths = (WIDTH_STEP * k for k in range(1, 1 + int(math.sqrt(count / layers)) // WIDTH_STEP + 2))
        width = min(widths, key=lambda w: abs(GPTShape(layers, w, 0).parameters - count))
        return GPTShape(layers, width, positions)

    @property
    def heads(self) -> int:
        return self.width // HEAD_SIZE

    @property
    def parameters(self) -> int:
        """Per layer: two norms, attention (3 projections and the output) and
        the 4x MLP, with biases; the tied embedding, the positions, the last norm."""
        d = self.width
        return self.layers * (12 * d * d + 13 * d) + (VOCABULARY + self.positions) * d + 2 * d

    def __str__(self) -> str:
        return (f"GPT-2's layout with {self.layers} layers, width {self.width}, {self.heads} heads, vocabulary "
                f"{VOCABULARY}, dropout {DROPOUT} ({self.parameters:,} parameters at {self.positions} positions)")

    def build(self) -> nn.Module:
        with torch.device("meta"):
            return AssumedGPT(self)


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        d = shape.width
        self.heads = shape.heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention, self.projection = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2)
                   for t in self.attention(self.ln_1(x)).split(width, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT, is_causal=True)
        a = a.transpose(1, 2).contiguous().reshape(batch, seq, width)
        x = x + F.dropout(self.projection(a), DROPOUT)
        h = self.up(self.ln_2(x))
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + F.dropout(self.down(h), DROPOUT)


class AssumedGPT(nn.Module):
    """Token ids (batch x sequence) to logits."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCABULARY, shape.width)
        self.positions = nn.Embedding(shape.positions, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = F.dropout(self.tokens(ids) + self.positions(positions), DROPOUT)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tokens.weight)  # tied, as GPT-2's
