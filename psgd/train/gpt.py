"""A small GPT (nanoGPT-shaped): token and position embeddings, pre-norm causal-attention blocks, a
weight-tied head. `--model gpt --dataset text` trains it as a character-level language model.

Contract: `GPT(vocab, block, width, layers, heads)` maps token ids (B, T <= block) to logits
(B, T, vocab); the training loss is psgd's `cross_entropy` (psgd/train/losses.py), which takes
(..., C) logits against (...) targets, so accuracy is per token. Parameters only (attention is
`F.scaled_dot_product_attention(is_causal=True)`: no mask buffer), float32, so every psgd mode
synchronises it whole. The head shares the token embedding's matrix (Press & Wolf 2017), as
nanoGPT does; `model.parameters()` lists it once, so it is pushed once. Initialisation as
nanoGPT's: N(0, 0.02), the residual projections scaled by 1/sqrt(2 x layers) (GPT-2).

    psgd run --model gpt --dataset text --mode sync --workers 2 --optimizer adamw --lr 3e-3 --steps 300
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # each position sees only the past
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        assert width % heads == 0, f"width {width} must be a multiple of heads {heads}"
        self.block = block
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("proj.weight", "mlp.2.weight"))  # the projections into the residual
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        assert t <= self.block, f"sequence of {t} tokens, the model's block is {self.block}"
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))
