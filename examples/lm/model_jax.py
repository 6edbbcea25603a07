"""A small pre-LN decoder-only transformer in Flax NNX, twin of `model_torch.GPT`.

Same architecture and submodule names as `model_torch` (see its docstring):
token and learned position embeddings, ``n_layers`` blocks ``x += attn(ln1(x));
x += mlp(ln2(x))``, a final LayerNorm and an untied, bias-free head. The
attention has an optional QK-norm (a scale-only LayerNorm over the head
dimension, shared by the heads: flax's ``normalize_qk``, Wortsman et al.
2023's qk-layernorm), the one cure of the naive run's failure.

``dtype`` is the compute dtype (flax's ``dtype=``: parameters are cast at
use, the residual stream, q.k and the softmax are in ``dtype``, LayerNorm
statistics in float32). ``model(tokens) -> (logits, stats)``: ``stats`` is
float32 [2, n_layers], stop-gradient: row 0 the max attention logit
``|q.k| / sqrt(head_dim)`` over the batch, heads and causal positions,
row 1 the lowest head's mean attention entropy in nats (0 when one-hot).

Functional use (a pure ``jax.jit`` train step)::

    graphdef, params = nnx.split(model, nnx.Param)
    logits, stats = apply(graphdef, params, tokens)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.lm.model_torch import INIT_STD, LN_EPS

__all__ = ["GPT", "apply", "attention_stats"]


def _linear(din, dout, *, rngs, std=INIT_STD, **kw):
    return nnx.Linear(
        din, dout, use_bias=False, kernel_init=nnx.initializers.normal(std),
        rngs=rngs, **kw,
    )  # fmt: skip


def attention_stats(logits: jax.Array, weights: jax.Array, causal: jax.Array):
    """``[max |logit| over causal positions, lowest head's mean entropy]``.

    Args:
      logits: attention logits [B, H, T, T] (already scaled by 1/sqrt(d)).
      weights: the softmax of the masked logits, same shape.
      causal: the [T, T] boolean mask of the positions attended to.

    Returns:
      float32 [2], stop-gradient.

    Example:
        >>> lg = jnp.array([[[[3.0, 0.0], [1.0, -2.0]]]])
        >>> mask = jnp.tril(jnp.ones((2, 2), bool))
        >>> w = jax.nn.softmax(jnp.where(mask, lg, -1e9), axis=-1)
        >>> [round(float(v), 4) for v in attention_stats(lg, w, mask)]
        [3.0, 0.0954]
    """
    amax = jnp.max(jnp.where(causal, jnp.abs(logits.astype(jnp.float32)), 0.0))
    w = weights.astype(jnp.float32)
    safe = jnp.where(w > 0, w, 1.0)
    ent = -jnp.sum(jnp.where(w > 0, w * jnp.log(safe), 0.0), axis=-1)
    ent = jnp.min(jnp.mean(ent, axis=(0, 2)))  # per head: mean over batch, queries
    return jax.lax.stop_gradient(jnp.stack([amax, ent]))


class Attention(nnx.Module):
    def __init__(self, d, n_heads, n_layers, *, qk_norm, rngs, dtype, param_dtype):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.n_heads, self.dtype = n_heads, dtype
        self.qkv = _linear(d, 3 * d, rngs=rngs, **kw)
        self.proj = _linear(d, d, rngs=rngs, std=INIT_STD / (2 * n_layers) ** 0.5, **kw)
        hd = d // n_heads
        norm = lambda: nnx.LayerNorm(  # noqa: E731
            hd, epsilon=LN_EPS, use_fast_variance=False, use_bias=False, rngs=rngs, **kw
        )
        self.q_norm = norm() if qk_norm else nnx.data(None)
        self.k_norm = norm() if qk_norm else nnx.data(None)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.n_heads
        hd = d // h
        qkv = self.qkv(x).reshape(b, t, 3, h, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q / jnp.sqrt(hd).astype(q.dtype)  # flax's order: scale q, then q.k
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        causal = jnp.tril(jnp.ones((t, t), bool))
        masked = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        w = jax.nn.softmax(masked, axis=-1).astype(q.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
        return self.proj(out), attention_stats(logits, w, causal)


class Block(nnx.Module):
    def __init__(self, d, n_heads, n_layers, *, qk_norm, rngs, dtype, param_dtype):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.ln1 = nnx.LayerNorm(
            d, epsilon=LN_EPS, use_fast_variance=False, rngs=rngs, **kw
        )
        self.attn = Attention(d, n_heads, n_layers, qk_norm=qk_norm, rngs=rngs, **kw)
        self.ln2 = nnx.LayerNorm(
            d, epsilon=LN_EPS, use_fast_variance=False, rngs=rngs, **kw
        )
        self.fc = _linear(d, 4 * d, rngs=rngs, **kw)
        self.out = _linear(
            4 * d, d, rngs=rngs, std=INIT_STD / (2 * n_layers) ** 0.5, **kw
        )

    def __call__(self, x):
        a, stats = self.attn(self.ln1(x))
        x = x + a
        x = x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))
        return x, stats


class GPT(nnx.Module):
    """The decoder (sizes as `model_torch.GPT`; ``dtype`` computes, ``param_dtype``
    stores).

    Example:
        >>> m = GPT(d_model=16, n_layers=1, n_heads=2, max_len=8, rngs=nnx.Rngs(0))
        >>> logits, stats = m(jnp.zeros((2, 8), jnp.int32))
        >>> logits.shape, stats.shape
        ((2, 8, 256), (2, 1))
    """

    def __init__(
        self, *, vocab=256, d_model=128, n_layers=2, n_heads=4, max_len=128,
        qk_norm=False, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs,
    ):  # fmt: skip
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        init = nnx.initializers.normal(INIT_STD)
        self.tok = nnx.Embed(vocab, d_model, embedding_init=init, rngs=rngs, **kw)
        self.pos = nnx.Embed(max_len, d_model, embedding_init=init, rngs=rngs, **kw)
        self.blocks = nnx.List(
            [
                Block(d_model, n_heads, n_layers, qk_norm=qk_norm, rngs=rngs, **kw)
                for _ in range(n_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(
            d_model, epsilon=LN_EPS, use_fast_variance=False, rngs=rngs, **kw
        )
        self.head = _linear(d_model, vocab, rngs=rngs, **kw)

    def __call__(self, tokens):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(jnp.arange(t))[None]
        stats = []
        for blk in self.blocks:
            x, s = blk(x)
            stats.append(s)
        return self.head(self.ln_f(x)), jnp.stack(stats, axis=1)


def apply(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array):
    """Pure forward pass ``(logits, stats)``; jit- and grad-friendly.

    Example:
        >>> m = GPT(d_model=16, n_layers=1, n_heads=2, max_len=4, rngs=nnx.Rngs(0))
        >>> graphdef, params = nnx.split(m, nnx.Param)
        >>> apply(graphdef, params, jnp.ones((1, 4), jnp.int32))[0].shape
        (1, 4, 256)
    """
    return nnx.merge(graphdef, params, copy=True)(tokens)
