"""A small pre-LN decoder-only transformer in torch, twin of `model_jax.GPT`.

* token embedding + LEARNED position embedding (``max_len``), blocks
  ``x += attn(ln1(x)); x += mlp(ln2(x))`` (MLP d -> 4d -> d, GELU with the
  tanh approximation), a final LayerNorm, an UNTIED head d -> 256; no
  biases in the Linears; LayerNorm eps 1e-6; init N(0, 0.02), residual output
  projections N(0, 0.02 / sqrt(2 n_layers)) (GPT-2's).
* attention: one fused qkv Linear, optional QK-norm (a scale-only LayerNorm
  over the head dimension, shared by the heads), q scaled by 1/sqrt(head_dim)
  BEFORE q.k (flax's order), causal mask with finfo.min, softmax in the
  compute dtype.
* ``dtype`` (compute) copies flax's ``dtype=`` explicitly: parameters stay
  float32 and are cast at use (LayerNorm scales too: the JAX runs get their
  parameters cast to the compute dtype); embeddings, the residual stream, q.k
  and the softmax are in ``dtype``; LayerNorm statistics are float32 and its
  output is in ``dtype``. ``torch.autocast("cpu", bfloat16)`` on a float32
  model is NOT the same arithmetic: there the embeddings and the residual
  stream stay float32, and CPU autocast runs softmax and layer_norm in
  bfloat16 (examples/lm/README.md). Under autocast this model computes as
  without it: every op it runs in ``dtype`` gets ``dtype`` inputs.

``model(tokens) -> (logits, stats)``: logits [B, T, 256] in ``dtype``; stats
float32 [2, n_layers] without gradient: the max attention logit and the
lowest head's mean attention entropy (nats) per layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LN_EPS = 1e-6
INIT_STD = 0.02


class LayerNorm(nn.Module):
    """flax's ``nnx.LayerNorm``: float32 statistics, output in the input dtype."""

    def __init__(self, d, *, bias=True):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x):
        dt = x.dtype
        w = self.scale.to(dt).float()
        b = None if self.bias is None else self.bias.to(dt).float()
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, LN_EPS).to(dt)


class Linear(nn.Module):
    """A bias-free Linear whose weight is cast to the input's dtype."""

    def __init__(self, din, dout, *, std=INIT_STD):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) * std)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))


def attention_stats(logits, weights, causal):
    """``[max |logit| over causal positions, lowest head's mean entropy]``
    (twin of `model_jax.attention_stats`), float32, no gradient.

    Example:
        >>> lg = torch.tensor([[[[3.0, 0.0], [1.0, -2.0]]]])
        >>> mask = torch.ones(2, 2, dtype=torch.bool).tril()
        >>> w = torch.softmax(lg.masked_fill(~mask, -1e9), dim=-1)
        >>> [round(float(v), 4) for v in attention_stats(lg, w, mask)]
        [3.0, 0.0954]
    """
    with torch.no_grad():
        amax = torch.where(causal, logits.float().abs(), 0.0).amax()
        w = weights.float()
        safe = torch.where(w > 0, w, 1.0)
        ent = -torch.where(w > 0, w * torch.log(safe), 0.0).sum(-1)
        return torch.stack([amax, ent.mean(dim=(0, 2)).min()])


class Attention(nn.Module):
    def __init__(self, d, n_heads, n_layers, *, qk_norm):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = Linear(d, 3 * d)
        self.proj = Linear(d, d, std=INIT_STD / math.sqrt(2 * n_layers))
        hd = d // n_heads
        self.q_norm = LayerNorm(hd, bias=False) if qk_norm else None
        self.k_norm = LayerNorm(hd, bias=False) if qk_norm else None

    def forward(self, x):
        b, t, d = x.shape
        h = self.n_heads
        hd = d // h
        q, k, v = self.qkv(x).reshape(b, t, 3, h, hd).unbind(2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q / torch.tensor(math.sqrt(hd), dtype=q.dtype)
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        w = F.softmax(logits.masked_fill(~causal, torch.finfo(logits.dtype).min), -1)
        w = w.to(q.dtype)
        out = torch.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
        return self.proj(out), attention_stats(logits, w, causal)


class Block(nn.Module):
    def __init__(self, d, n_heads, n_layers, *, qk_norm):
        super().__init__()
        self.ln1 = LayerNorm(d)
        self.attn = Attention(d, n_heads, n_layers, qk_norm=qk_norm)
        self.ln2 = LayerNorm(d)
        self.fc = Linear(d, 4 * d)
        self.out = Linear(4 * d, d, std=INIT_STD / math.sqrt(2 * n_layers))

    def forward(self, x):
        a, stats = self.attn(self.ln1(x))
        x = x + a
        x = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x, stats


class GPT(nn.Module):
    """The decoder; ``dtype`` is the compute dtype (see the module docstring).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> m = GPT(d_model=16, n_layers=1, n_heads=2, max_len=8)
        >>> logits, stats = m(torch.zeros(2, 8, dtype=torch.long))
        >>> tuple(logits.shape), tuple(stats.shape)
        ((2, 8, 256), (2, 1))
        >>> GPT(d_model=10, n_heads=4)
        Traceback (most recent call last):
        ...
        ValueError: d_model must be a multiple of n_heads, got 10 and 4
    """

    def __init__(
        self, *, vocab=256, d_model=128, n_layers=2, n_heads=4, max_len=128,
        qk_norm=False, dtype=torch.float32,
    ):  # fmt: skip
        super().__init__()
        if d_model % n_heads:
            raise ValueError(
                f"d_model must be a multiple of n_heads, got {d_model} and {n_heads}"
            )
        self._arch = dict(
            vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
            max_len=max_len, qk_norm=qk_norm,
        )  # fmt: skip
        self.dtype = dtype
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.tok.weight, std=INIT_STD)
        nn.init.normal_(self.pos.weight, std=INIT_STD)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, n_layers, qk_norm=qk_norm) for _ in range(n_layers)
        )
        self.ln_f = LayerNorm(d_model)
        self.head = Linear(d_model, vocab)

    def architecture(self) -> dict:
        """The constructor's sizes (what `convert.nnx_from_torch` rebuilds)."""
        return dict(self._arch)

    def forward(self, tokens):
        t = tokens.shape[1]
        dt = self.dtype
        x = self.tok.weight.to(dt)[tokens] + self.pos.weight.to(dt)[:t][None]
        stats = []
        for blk in self.blocks:
            x, s = blk(x)
            stats.append(s)
        return self.head(self.ln_f(x)), torch.stack(stats, dim=1)
