"""Showcase: low-precision logits through the naive path vs jaxstable / torchref.

Run: .venv/bin/python examples/showcase_losses.py   (`make demo`, ~10 s on CPU)

Every number printed is computed here, on this machine; nothing is canned.
The cases are failure patterns of docs/failure_patterns.md: segmentation
cross-entropy on fp16/bf16 logits (1), the DBNet step function (3), InfoNCE
logits / 0.07 in bf16 (5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F

from jaxstable import losses as jl
from torchref import losses as tl


def f64_ce(x: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy in float64, classes last: the reference."""
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(x - m).sum(-1))
    return float(np.mean(lse - np.take_along_axis(x, y[..., None], -1)[..., 0]))


def show(name: str, value, note: str = "") -> None:
    if isinstance(value, torch.Tensor):
        dtype, v = (
            str(value.dtype).removeprefix("torch."),
            float(value.detach().float()),
        )
    else:
        dtype, v = str(jnp.asarray(value).dtype), float(jnp.asarray(value, jnp.float32))
    flag = "finite" if np.isfinite(v) else "NON-FINITE"
    print(f"  {name:<46} {v + 0.0:>14.6g}  {dtype:<9} {flag:<10} {note}")


def segmentation(scale: float, dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 64, 64, 19)) * scale
    if dtype == "float16":
        x = np.clip(x, -60000.0, 60000.0)  # the inputs themselves stay finite
    x = np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))
    y = rng.integers(0, 19, size=(2, 64, 64))
    xl, yj = jnp.asarray(x).astype(dtype), jnp.asarray(y)
    print(
        f"\n[seeds/000] segmentation logits 2x64x64x19 in {dtype}, "
        f"max |x| = {np.abs(x).max():.3g}"
    )
    show("float64 reference", np.float64(f64_ce(x, y)))
    naive_exp = -jnp.mean(
        jnp.log(
            jnp.take_along_axis(jnp.exp(xl), yj[..., None], -1)[..., 0]
            / jnp.sum(jnp.exp(xl), -1)
        )
    )
    show(f"naive softmax (exp / sum exp) in {dtype}", naive_exp, "exp overflows")
    per = optax.softmax_cross_entropy_with_integer_labels(xl, yj)
    show(f"optax CE in {dtype}, mean", jnp.mean(per))
    show(f"optax CE in {dtype}, sum", jnp.sum(per), "sum accumulates in dtype")
    xt = torch.tensor(np.moveaxis(x, -1, 1).copy()).to(getattr(torch, dtype))
    show(
        f"torch F.cross_entropy on {dtype} (no autocast)",
        F.cross_entropy(xt, torch.tensor(y)),
    )
    show("jaxstable softmax_cross_entropy", jl.softmax_cross_entropy(xl, yj))
    show(
        "jaxstable softmax_cross_entropy, sum",
        jl.softmax_cross_entropy(xl, yj, reduction="sum"),
    )
    show(
        "torchref softmax_cross_entropy", tl.softmax_cross_entropy(xt, torch.tensor(y))
    )
    g = jax.grad(lambda v: jl.softmax_cross_entropy(v, yj))(xl)
    finite = bool(jnp.all(jnp.isfinite(g)))
    print(f"  jaxstable gradient: dtype {g.dtype}, all finite: {finite}")


def db_step() -> None:
    print("\n[seeds/002] DBNet step, k=50, prob and thresh on a 101x101 grid of [0, 1]")
    grid = np.linspace(0.0, 1.0, 101, dtype=np.float32)
    xs, ys = np.meshgrid(grid, grid)
    for dtype in ("float16", "bfloat16", "float32"):
        xd, yd = jnp.asarray(xs).astype(dtype), jnp.asarray(ys).astype(dtype)
        ref = jax.grad(lambda a, b=yd: jnp.sum(1.0 / (1.0 + jnp.exp(-50.0 * (a - b)))))(
            xd
        )
        ours = jax.grad(lambda a, b=yd: jnp.sum(jl.db_step(a, b)))(xd)
        print(
            f"  {dtype:<9} reciprocal(1+exp(-k(x-y))) non-finite grads: "
            f"{int(np.sum(~np.isfinite(np.asarray(ref, np.float32)))):>5} / {ref.size}"
            f"   db_step: {int(np.sum(~np.isfinite(np.asarray(ours, np.float32))))}"
        )
    xt = torch.tensor(xs).half().requires_grad_()
    torch.reciprocal(
        1 + torch.exp(-50 * (xt - torch.tensor(ys).half()))
    ).sum().backward()
    xo = torch.tensor(xs).half().requires_grad_()
    tl.db_step(xo, torch.tensor(ys).half()).sum().backward()
    print(
        "  torch fp16 reference non-finite grads: "
        f"{int((~torch.isfinite(xt.grad)).sum())}"
        f"   torchref.db_step: {int((~torch.isfinite(xo.grad)).sum())}"
    )
    diff = np.abs(
        np.asarray(jl.db_step(jnp.asarray(xs), jnp.asarray(ys)))
        - 1 / (1 + np.exp(-50 * (xs - ys)))
    )
    print(f"  max |db_step - reference| in float32: {diff.max():.2e}")


def info_nce() -> None:
    print("\n[seeds/004] contrastive similarity 13.57 / 0.07 = 193.8 in bfloat16")
    s = jnp.asarray([[13.57, 4.47], [4.47, 13.57]], jnp.bfloat16) / 0.07
    naive = -jnp.mean(
        jnp.log(jnp.diagonal(jnp.exp(s) / jnp.sum(jnp.exp(s), -1, keepdims=True)))
    )
    show("naive softmax CE in bfloat16", naive, "exp overflows above 88.7")
    show(
        "max-subtracted log_softmax in float32",
        -jnp.mean(jnp.diagonal(jax.nn.log_softmax(s.astype(jnp.float32)))),
    )
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(8, 32)), jnp.bfloat16)
    show(
        "jaxstable info_nce(temperature=1e-4 -> 0.01)",
        jl.info_nce(a, a, temperature=1e-4),
    )
    show("jaxstable info_nce with an all-zero row", jl.info_nce(a.at[0].set(0), a))


def main() -> None:
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}")
    print(f"  {'computation':<46} {'value':>14}  {'dtype':<9} {'status':<10}")
    segmentation(2000.0, "float16")
    segmentation(30000.0, "float16")
    segmentation(1e30, "bfloat16")
    db_step()
    info_nce()


if __name__ == "__main__":
    main()
