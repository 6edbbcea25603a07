"""Parity of the detection losses (box_iou_loss, sigmoid_focal_loss).

Three-way: jaxstable vs torchref vs a float64 re-statement of torchvision's
formulas written here (`_ref_box`, `_ref_focal`: torch float64 autograd on the
documented definitions, independent of the code under test), and vs
torchvision itself where it imports (its PyPI wheels are CUDA builds whose
extension does not load with the CPU torch of CI; the GPU machine has it).

Where torchvision's value or gradient is non-finite (CIoU at a zero-height or
point box, focal loss with gamma < 1 at a saturated logit) the tests first
check that the reference really is non-finite there, then compare ours with
the documented continuous extension (`angle="extended"`), which equals the
reference wherever the reference is finite.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jaxstable import losses as jl
from torchref import losses as tl

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

DTYPES = ["float32", "bfloat16", "float16"]
KINDS = ["iou", "giou", "diou", "ciou"]
REDUCTIONS = ["none", "mean", "sum"]
EPS = 1e-7


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Small eager torch ops: 2 threads on the loaded 2-core machine made a
    tiny conv 38x slower (17.6 ms vs 0.46 ms, measured); one thread here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _round(x, dtype: str) -> np.ndarray:
    """The float32 values `x` takes once stored in `dtype`."""
    return np.array(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _close(a, b, tol):
    chex.assert_trees_all_close(_np(a), _np(b), **tol)


# ---------------------------------------------------------------------------
# float64 references: torchvision's definitions, restated
# ---------------------------------------------------------------------------


def _tv_angle(w, h):
    return torch.atan(w / h)  # torchvision: NaN gradient at h = 0, NaN at 0 / 0


def _extended_angle(w, h):
    """The documented deviation: atan2 (the continuous extension at h = 0),
    and 0 for a point box."""
    point = (w == 0) & (h == 0)
    angle = torch.atan2(w, torch.where(point, torch.ones_like(h), h))
    return torch.where(point, torch.zeros_like(angle), angle)


def _ref_box(b1, b2, kind, eps=EPS, angle=_tv_angle):
    """torchvision's IoU-family losses on float64 tensors (x1, y1, x2, y2)."""
    x1, y1, x2, y2 = b1.unbind(-1)
    x1g, y1g, x2g, y2g = b2.unbind(-1)
    xk1, yk1 = torch.max(x1, x1g), torch.max(y1, y1g)
    xk2, yk2 = torch.min(x2, x2g), torch.min(y2, y2g)
    inter = torch.zeros_like(x1)
    mask = (yk2 > yk1) & (xk2 > xk1)
    inter[mask] = (xk2[mask] - xk1[mask]) * (yk2[mask] - yk1[mask])
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + eps)
    xc1, yc1 = torch.min(x1, x1g), torch.min(y1, y1g)
    xc2, yc2 = torch.max(x2, x2g), torch.max(y2, y2g)
    if kind == "iou":
        return 1 - iou
    if kind == "giou":
        area_c = (xc2 - xc1) * (yc2 - yc1)
        return 1 - (iou - (area_c - union) / (area_c + eps))
    diag = (xc2 - xc1) ** 2 + (yc2 - yc1) ** 2 + eps
    centres = ((x2 + x1) / 2 - (x1g + x2g) / 2) ** 2 + (
        (y2 + y1) / 2 - (y1g + y2g) / 2
    ) ** 2
    diou = 1 - iou + centres / diag
    if kind == "diou":
        return diou
    v = (4 / math.pi**2) * (angle(x2g - x1g, y2g - y1g) - angle(x2 - x1, y2 - y1)) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return diou + alpha * v


def _ref_box_grad(b1, b2, kind, cot, angle=_tv_angle):
    """Reference loss per box and gradients of sum(loss * cot), float64."""
    t1 = torch.tensor(b1, dtype=torch.float64, requires_grad=True)
    t2 = torch.tensor(b2, dtype=torch.float64, requires_grad=True)
    loss = _ref_box(t1, t2, kind, angle=angle)
    (loss * torch.tensor(cot, dtype=torch.float64)).sum().backward()
    return loss.detach().numpy(), t1.grad.numpy(), t2.grad.numpy()


def _ref_reduced(loss, grads, reduction):
    """Reference value and gradients of a reduction, from the per-element
    ones (taken with a cotangent of ones for "sum" and "mean")."""
    if reduction == "none":
        return loss, *grads
    scale = 1.0 if reduction == "sum" else 1.0 / max(loss.size, 1)
    return loss.sum() * scale, *(g * scale for g in grads)


# ---------------------------------------------------------------------------
# the code under test. XLA:CPU compiles take 1-3 s each on the shared 2-core
# machine, so one jitted function computes every kind for a dtype ('none',
# with a random cotangent so that every box's gradient is checked), and every
# box test uses the same N boxes (one compile per dtype, reused).
# ---------------------------------------------------------------------------


@functools.cache
def _jax_kinds(reduction):
    def f(b1, b2, cot):
        def total(b1, b2):
            out = [jl.box_iou_loss(b1, b2, kind=k, reduction=reduction) for k in KINDS]
            return sum(jnp.sum(o * c) for o, c in zip(out, cot, strict=True)), out

        return jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(b1, b2)

    return jax.jit(f)


def _jax_run(b1, b2, dtype, cot, reduction="none"):
    """{kind: (loss, grad1, grad2)}; the gradient is that of every kind's
    sum(loss * cot[kind]) at once, so the kinds get different cotangents."""
    (_, outs), (g1, g2) = _jax_kinds(reduction)(
        jnp.asarray(b1).astype(dtype), jnp.asarray(b2).astype(dtype), cot
    )
    assert all(o.dtype == jnp.float32 for o in outs) and g1.dtype == jnp.dtype(dtype)
    return outs, g1, g2


def _torch_run(b1, b2, dtype, cot, reduction="none"):
    t1 = torch.tensor(b1, dtype=torch.float32).to(getattr(torch, dtype))
    t2 = torch.tensor(b2, dtype=torch.float32).to(getattr(torch, dtype))
    t1.requires_grad_(True)
    t2.requires_grad_(True)
    outs = [tl.box_iou_loss(t1, t2, kind=k, reduction=reduction) for k in KINDS]
    sum((o * torch.tensor(c)).sum() for o, c in zip(outs, cot, strict=True)).backward()
    assert all(o.dtype == torch.float32 for o in outs)
    assert t1.grad.dtype == getattr(torch, dtype)
    return outs, t1.grad, t2.grad


def _ref_run(b1, b2, cot, reduction="none", angle=_extended_angle):
    """The reference's (losses, grad1, grad2) in the layout of _jax_run."""
    outs, g1, g2 = [], 0.0, 0.0
    for kind, c in zip(KINDS, cot, strict=True):
        weights = np.broadcast_to(c, b1.shape[:-1])
        loss, d1, d2 = _ref_box_grad(b1, b2, kind, weights, angle=angle)
        loss, d1, d2 = _ref_reduced(loss, (d1, d2), reduction)
        outs.append(loss)
        g1, g2 = g1 + d1, g2 + d2
    return outs, g1, g2


def _random_boxes(rng, shape, scale):
    """Valid boxes with a mix of overlapping, nested and disjoint pairs."""
    c1 = rng.uniform(0, scale, size=(*shape, 2))
    wh1 = rng.uniform(0.05, 0.5, size=(*shape, 2)) * scale
    c2 = c1 + rng.normal(size=(*shape, 2)) * wh1 * 0.6
    wh2 = wh1 * rng.uniform(0.4, 2.5, size=(*shape, 2))
    b1 = np.concatenate([c1 - wh1 / 2, c1 + wh1 / 2], -1)
    b2 = np.concatenate([c2 - wh2 / 2, c2 + wh2 / 2], -1)
    return b1.astype(np.float32), b2.astype(np.float32)


# (name, boxes1, boxes2): degenerate pairs seen in detection pipelines (small
# integers: exact in every dtype)
DEGENERATE = [
    ("identical", [1.0, 2.0, 5.0, 4.0], [1.0, 2.0, 5.0, 4.0]),
    ("zero_height_pred", [0.0, 0.0, 4.0, 0.0], [1.0, 0.0, 3.0, 2.0]),
    ("zero_height_target", [1.0, 0.0, 3.0, 2.0], [0.0, 1.0, 4.0, 1.0]),
    ("zero_width_pred", [2.0, 0.0, 2.0, 3.0], [1.0, 0.0, 3.0, 2.0]),
    ("point_pred", [2.0, 2.0, 2.0, 2.0], [1.0, 0.0, 3.0, 2.0]),
    ("point_both_identical", [2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]),
    ("zero_area_union", [0.0, 1.0, 4.0, 1.0], [1.0, 3.0, 3.0, 3.0]),
    ("coincident_centres", [0.0, 0.0, 4.0, 2.0], [1.0, -1.0, 3.0, 3.0]),
    ("touching_edges", [0.0, 0.0, 2.0, 2.0], [2.0, 0.0, 4.0, 2.0]),
    ("disjoint", [0.0, 0.0, 1.0, 1.0], [5.0, 6.0, 7.0, 9.0]),
    ("nested", [0.0, 0.0, 8.0, 8.0], [2.0, 3.0, 4.0, 4.0]),
]
NAMES = [c[0] for c in DEGENERATE]
N_RANDOM = 13
N_BOXES = N_RANDOM + len(DEGENERATE)
# Where torchvision's formulas are non-finite (checked, so that this table
# cannot go stale silently): (kind, case) -> "value" or "grad"
TV_NON_FINITE = {
    ("ciou", "zero_height_pred"): "grad",
    ("ciou", "zero_height_target"): "grad",
    ("ciou", "point_pred"): "value",
    ("ciou", "point_both_identical"): "value",
    ("ciou", "zero_area_union"): "grad",
}


def _boxes(seed, dtype, scale):
    """N_RANDOM random pairs, then the DEGENERATE ones, rounded to dtype."""
    b1, b2 = _random_boxes(np.random.default_rng(seed), (N_RANDOM,), scale)
    b1 = np.concatenate([b1, np.array([c[1] for c in DEGENERATE], np.float32)])
    b2 = np.concatenate([b2, np.array([c[2] for c in DEGENERATE], np.float32)])
    return _round(b1, dtype), _round(b2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_box_losses_match_reference(dtype, tol):
    """Every kind, random and degenerate pairs: finite values and gradients in
    both frameworks, equal to the float64 reference (the documented
    extension where torchvision's formulas are non-finite, theirs elsewhere):
    values to float32 rounding, gradients to one rounding of the input dtype.
    fp16 boxes are at the 640-pixel scale, where their areas exceed fp16's
    65504 (a naive fp16 area is inf)."""
    scale = 640.0 if dtype == "float16" else 16.0
    b1, b2 = _boxes(DTYPES.index(dtype), dtype, scale)
    if dtype == "float16":
        assert ((b2[:, 2] - b2[:, 0]) * (b2[:, 3] - b2[:, 1])).max() > 65504
    cot = np.random.default_rng(1).uniform(0.5, 2.0, (len(KINDS), N_BOXES))
    cot = cot.astype(np.float32)
    ref = _ref_run(b1, b2, cot)
    for run in (_jax_run, _torch_run):
        outs, g1, g2 = run(b1, b2, dtype, cot)
        for kind, out, ref_out in zip(KINDS, outs, ref[0], strict=True):
            assert np.isfinite(_np(out)).all(), kind
            _close(out, ref_out, tol("float32"))
        assert np.isfinite(_np(g1)).all() and np.isfinite(_np(g2)).all()
        _close(g1, ref[1], tol(dtype))
        _close(g2, ref[2], tol(dtype))


def test_reference_extension_equals_torchvision_where_it_is_finite():
    """The documented deviation only replaces non-finite values: the
    extension equals torchvision's formulas wherever those are finite, and
    those are non-finite exactly at TV_NON_FINITE (float64, no code under
    test: the oracle of the test above)."""
    b1, b2 = _boxes(0, "float32", 16.0)
    for kind in KINDS:
        ones = np.ones(N_BOXES)
        tv = _ref_box_grad(b1, b2, kind, ones, angle=_tv_angle)
        ext = _ref_box_grad(b1, b2, kind, ones, angle=_extended_angle)
        value_ok = np.isfinite(tv[0])
        grad_ok = np.isfinite(tv[1]).all(-1) & np.isfinite(tv[2]).all(-1)
        for i, name in enumerate(NAMES, start=N_RANDOM):
            expected = TV_NON_FINITE.get((kind, name))
            assert (expected == "value") == (not value_ok[i]), (kind, name)
            assert (expected is not None) == (not grad_ok[i]), (kind, name)
        assert value_ok[:N_RANDOM].all() and grad_ok[:N_RANDOM].all()
        np.testing.assert_allclose(ext[0][value_ok], tv[0][value_ok], rtol=1e-12)
        for e, t in zip(ext[1:], tv[1:], strict=True):
            np.testing.assert_allclose(e[grad_ok], t[grad_ok], rtol=1e-12)


def test_box_loss_reductions(tol):
    """'mean' and 'sum' of every kind, values and gradients (torch; JAX's
    reductions are the one `_reduce` that test_focal_loss_reductions checks
    with gradients, and test_empty_boxes_every_reduction on boxes)."""
    b1, b2 = _boxes(3, "float32", 16.0)
    for reduction in ("mean", "sum"):
        cot = np.float32([1.0, 0.5, 2.0, 1.5])  # one per kind
        ref = _ref_run(b1, b2, cot, reduction)
        outs, g1, g2 = _torch_run(b1, b2, "float32", cot, reduction)
        for out, ref_out in zip(outs, ref[0], strict=True):
            assert out.shape == ()
            _close(out, ref_out, tol("float32"))
        _close(g1, ref[1], tol("float32"))
        _close(g2, ref[2], tol("float32"))


# (name, prediction, target): the kinks of the IoU family, where max/min tie,
# a side is zero or the enclosing box has zero area ("flat"); sides 2 to 6,
# where a gradient of the losses is at most about 1 / side.
KINKS = [
    ("equal", [1.0, 2.0, 5.0, 4.0], [1.0, 2.0, 5.0, 4.0]),
    ("zero_width_equal", [3.0, 3.0, 3.0, 9.0], [3.0, 3.0, 3.0, 9.0]),
    ("zero_height_equal", [3.0, 3.0, 9.0, 3.0], [3.0, 3.0, 9.0, 3.0]),
    ("point_equal", [2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]),
    ("point_on_target_line", [3.0, 5.0, 3.0, 5.0], [3.0, 3.0, 3.0, 9.0]),
    ("zero_width_on_target_line", [3.0, 4.0, 3.0, 6.0], [3.0, 3.0, 3.0, 9.0]),
    ("zero_height_on_target_line", [4.0, 3.0, 6.0, 3.0], [3.0, 3.0, 9.0, 3.0]),
    ("zero_width_apart_on_a_line", [3.0, 0.0, 3.0, 2.0], [3.0, 5.0, 3.0, 9.0]),
    ("collinear", [0.0, 1.0, 4.0, 1.0], [1.0, 1.0, 3.0, 1.0]),
    ("across_target_line", [2.0, 3.0, 4.0, 9.0], [3.0, 3.0, 3.0, 9.0]),
    ("zero_width_inside", [3.0, 4.0, 3.0, 6.0], [2.0, 3.0, 4.0, 9.0]),
    ("shared_edges", [1.0, 2.0, 5.0, 4.0], [1.0, 2.0, 3.0, 4.0]),
]
# An enclosing box of zero area, where torchvision's GIoU gradient is ~1e7
# (not for two equal points: there every side's gradient is 0).
FLAT = {
    "zero_width_equal",
    "zero_height_equal",
    "point_on_target_line",
    "zero_width_on_target_line",
    "zero_height_on_target_line",
    "zero_width_apart_on_a_line",
    "collinear",
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_box_loss_kinks_have_small_finite_gradients(dtype, tol):
    """Issue 35: GIoU's gradient was +-inf in fp16 (3e7 in float32) for
    [3, 3, 3, 9] over itself, and ~1e7 wherever the enclosing box has zero
    area: torchvision's (d area_c - d union) / eps, the ties of max/min
    splitting d area_c in halves. Now every kind, in both frameworks and
    every dtype, has a finite gradient of at most 1 on these boxes (sides 2
    to 6), the values are the reference's (torchvision's formulas), and the
    gradients are the reference's wherever that is not such an eps blow-up.
    """
    b1, b2 = _boxes(5, "float32", 16.0)  # the shared shape: no new compile
    n = len(KINKS)
    b1[:n] = [k[1] for k in KINKS]
    b2[:n] = [k[2] for k in KINKS]
    flat = np.array([k[0] in FLAT for k in KINKS])
    for kind in KINDS:
        cot = np.zeros((len(KINDS), N_BOXES), np.float32)
        cot[KINDS.index(kind)] = 1.0
        ref_out, ref_g1, ref_g2 = _ref_run(b1, b2, cot)
        ref_g = np.concatenate([ref_g1, ref_g2], -1)[:n]
        blown = np.abs(ref_g).max(-1) > 1e6  # torchvision's eps blow-up
        assert (blown == (flat if kind == "giou" else False)).all(), kind
        for run in (_jax_run, _torch_run):
            outs, g1, g2 = run(b1, b2, dtype, cot)
            got = np.concatenate([_np(g1), _np(g2)], -1)[:n]
            out = _np(outs[KINDS.index(kind)])[:n]
            _close(out, ref_out[KINDS.index(kind)][:n], tol("float32"))
            assert np.isfinite(got).all(), (kind, run.__name__, got)
            worst = np.abs(got).max(-1)
            assert (worst <= 1.0).all(), (kind, run.__name__, worst)
            _close(got[~blown], ref_g[~blown], tol(dtype))


def test_empty_boxes_every_reduction():
    """Zero boxes: 'none' is empty, 'sum' and 'mean' are 0.0 (torchvision's
    mean of no boxes is 0.0 too), in both frameworks."""
    empty = np.zeros((0, 4), np.float32)
    for reduction in REDUCTIONS:
        j = jl.box_iou_loss(empty, empty, kind="iou", reduction=reduction)
        t = tl.box_iou_loss(torch.tensor(empty), torch.tensor(empty), kind="iou",
                            reduction=reduction)  # fmt: skip
        expected = np.zeros((0,)) if reduction == "none" else np.float64(0.0)
        for out in (j, t):
            np.testing.assert_array_equal(_np(out), expected, strict=True)


def test_non_finite_coordinate_gives_nan_for_that_pair_only():
    """A NaN or inf coordinate: that pair's loss and gradient are NaN (the
    guard sees it), the other pairs are untouched, every kind, both
    frameworks."""
    b1, b2 = _boxes(5, "float32", 16.0)
    b1[1, 2] = np.nan
    b2[3, 0] = -np.inf
    bad = np.isin(np.arange(N_BOXES), [1, 3])
    cot = np.ones((len(KINDS), N_BOXES), np.float32)
    for run in (_jax_run, _torch_run):
        outs, g1, _ = run(b1, b2, "float32", cot)
        for out in outs:
            assert np.isnan(_np(out)[bad]).all() and np.isfinite(_np(out)[~bad]).all()
        g1 = _np(g1)
        assert np.isnan(g1[bad]).all() and np.isfinite(g1[~bad]).all()


def test_inverted_box_under_jit_is_nan_not_finite():
    """JAX under jit cannot raise: an x2 < x1 box makes its pair's loss and
    gradient NaN (eager calls raise in both frameworks: the bad-input table)."""
    b1, b2 = _boxes(6, "float32", 16.0)
    b1[2] = b1[2, [2, 1, 0, 3]]  # x1 > x2
    outs, g1, _ = _jax_run(b1, b2, "float32", np.ones((4, N_BOXES), np.float32))
    for out in outs:
        out = np.asarray(out)
        assert np.isnan(out[2]) and np.isfinite(np.delete(out, 2)).all()
    assert np.isnan(np.asarray(g1)[2]).all()


# ---------------------------------------------------------------------------
# sigmoid focal loss
# ---------------------------------------------------------------------------


def _ref_focal(x, t, alpha, gamma):
    """torchvision's sigmoid_focal_loss in float64 (per element)."""
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    p_t = p * t + (1 - p) * (1 - t)
    loss = ce * ((1 - p_t) ** gamma)
    if alpha is not None and alpha >= 0:
        loss = (alpha * t + (1 - alpha) * (1 - t)) * loss
    return loss


def _ref_focal_grad(x, t, alpha, gamma, cot):
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    loss = _ref_focal(xt, torch.tensor(t, dtype=torch.float64), alpha, gamma)
    (loss * torch.tensor(cot, dtype=torch.float64)).sum().backward()
    return loss.detach().numpy(), xt.grad.numpy()


# (alpha, gamma, soft targets): the last one, gamma < 1, also has saturated
# logits (SATURATED) where torchvision's gradient is NaN
FOCAL_CONFIGS = [(0.25, 2.0, False), (None, 2.0, True), (0.5, 0.0, False),
                 (0.25, 0.5, False)]  # fmt: skip
SATURATED = (np.array([0, 0]), np.array([0, 0]), np.array([0, 1]))
FOCAL_SHAPE = (2, 3, 6)


def _focal_case(dtype):
    """Logits of scale 0.1, 3 and 30 (rows), targets and a cotangent for
    every config, rounded to dtype; |x| = 200 at SATURATED in the last."""
    rng = np.random.default_rng(DTYPES.index(dtype))
    scale = np.array([0.1, 3.0, 30.0])[:, None]
    xs, ts = [], []
    for _, _, soft in FOCAL_CONFIGS:
        xs.append(_round(rng.normal(size=FOCAL_SHAPE) * scale, dtype))
        t = rng.random(FOCAL_SHAPE) if soft else rng.random(FOCAL_SHAPE) < 0.3
        ts.append(t.astype(np.float32))
    xs[-1][SATURATED], ts[-1][SATURATED] = [200.0, -200.0], [1.0, 0.0]
    cot = rng.uniform(0.5, 2.0, (len(FOCAL_CONFIGS), *FOCAL_SHAPE))
    return xs, ts, cot.astype(np.float32)


@functools.cache
def _jax_focal(reduction):
    """Every config in one jitted function: [(loss, grad)]."""

    def f(xs, ts, cots):
        out = []
        for (alpha, gamma, _), x, t, c in zip(FOCAL_CONFIGS, xs, ts, cots, strict=True):

            def g(v, t=t, c=c, alpha=alpha, gamma=gamma):
                o = jl.sigmoid_focal_loss(v, t, alpha=alpha, gamma=gamma,
                                          reduction=reduction)  # fmt: skip
                return jnp.sum(o * c), o

            (_, o), d = jax.value_and_grad(g, has_aux=True)(x)
            out.append((o, d))
        return out

    return jax.jit(f)


def _torch_focal(x, t, alpha, gamma, reduction, dtype, cot):
    xt = torch.tensor(x).to(getattr(torch, dtype)).requires_grad_(True)
    out = tl.sigmoid_focal_loss(
        xt, torch.tensor(t), alpha=alpha, gamma=gamma, reduction=reduction
    )
    (out * torch.tensor(cot)).sum().backward()
    assert out.dtype == torch.float32 and xt.grad.dtype == getattr(torch, dtype)
    return out, xt.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_focal_loss_matches_reference(dtype, tol):
    """Every config, hard and soft targets, 'none' with a random cotangent:
    JAX and torch vs torchvision's formula in float64. At the saturated
    logits (gamma = 0.5, |x| = 200) torchvision's 1 - p_t is exactly 0 and
    its gradient 0.5 * 0**-0.5 * 0 = NaN (so is float64's at a random |x| > 37);
    ours is finite there, ~0 (the true gradient), and the value the same."""
    xs, ts, cots = _focal_case(dtype)
    jax_out = _jax_focal("none")([jnp.asarray(x).astype(dtype) for x in xs], ts, cots)
    for i, (alpha, gamma, _) in enumerate(FOCAL_CONFIGS):
        ref_loss, ref_grad = _ref_focal_grad(xs[i], ts[i], alpha, gamma, cots[i])
        finite = np.isfinite(ref_grad)
        assert finite.all() == (i < len(FOCAL_CONFIGS) - 1)
        torch_out = _torch_focal(xs[i], ts[i], alpha, gamma, "none", dtype, cots[i])
        for out, grad in (jax_out[i], torch_out):
            assert out.dtype in (jnp.float32, torch.float32)
            assert grad.dtype in (jnp.dtype(dtype), getattr(torch, dtype))
            _close(out, ref_loss, tol("float32"))
            grad = _np(grad)
            _close(grad[finite], ref_grad[finite], tol(dtype))
            # the true gradient there is below 1e-30 (and finite)
            assert np.isfinite(grad).all() and (np.abs(grad[~finite]) < 1e-6).all()
    assert not np.isfinite(
        _ref_focal_grad(xs[-1], ts[-1], 0.25, 0.5, cots[-1])[1][SATURATED]
    ).any()


def test_focal_loss_reductions(tol):
    """'mean' and 'sum', values and gradients, both frameworks."""
    xs, ts, _ = _focal_case("float32")
    ones = np.ones((len(FOCAL_CONFIGS), *FOCAL_SHAPE), np.float32)
    for reduction in ("mean", "sum"):
        jax_out = _jax_focal(reduction)(xs, ts, np.ones(len(FOCAL_CONFIGS), np.float32))
        for i, (alpha, gamma, _) in enumerate(FOCAL_CONFIGS[:-1]):
            per, grad = _ref_focal_grad(xs[i], ts[i], alpha, gamma, ones[i])
            ref = _ref_reduced(per, (grad,), reduction)
            torch_out = _torch_focal(xs[i], ts[i], alpha, gamma, reduction,
                                     "float32", np.float32(1.0))  # fmt: skip
            for out, grad in (jax_out[i], torch_out):
                assert out.shape == ()
                _close(out, ref[0], tol("float32"))
                _close(grad, ref[1], tol("float32"))


def test_focal_loss_empty_mean_is_zero():
    """torchvision's mean of an empty tensor is NaN; ours is 0.0 (documented,
    as every loss here)."""
    e = np.zeros((0, 3), np.float32)
    assert float(jl.sigmoid_focal_loss(e, e, reduction="mean")) == 0.0
    assert float(tl.sigmoid_focal_loss(torch.tensor(e), torch.tensor(e),
                                       reduction="mean")) == 0.0  # fmt: skip


# ---------------------------------------------------------------------------
# torchvision itself, where it imports (the GPU machine)
# ---------------------------------------------------------------------------

TV_LOSSES = {
    "giou": "generalized_box_iou_loss",
    "diou": "distance_box_iou_loss",
    "ciou": "complete_box_iou_loss",
}


def test_box_losses_match_torchvision(tol):
    """torchvision itself (GPU machine): values and gradients of every pair
    where its result is finite, its non-finite pairs exactly TV_NON_FINITE,
    and every reduction."""
    tv = pytest.importorskip("torchvision")
    b1, b2 = _boxes(7, "float32", 64.0)
    for k, kind in enumerate(KINDS):
        if kind not in TV_LOSSES:
            continue
        tv_loss = getattr(tv.ops, TV_LOSSES[kind])
        t1 = torch.tensor(b1, requires_grad=True)
        t2 = torch.tensor(b2, requires_grad=True)
        per_box = tv_loss(t1, t2, reduction="none", eps=EPS)
        grads = torch.autograd.grad(per_box.sum(), (t1, t2))
        ok = per_box.isfinite() & grads[0].isfinite().all(-1)
        ok = (ok & grads[1].isfinite().all(-1)).numpy()
        bad = {NAMES[i - N_RANDOM] for i in np.flatnonzero(~ok)}
        assert bad == {n for (kd, n) in TV_NON_FINITE if kd == kind}
        # a cotangent of ones for this kind only: its gradient alone
        cot = np.zeros((len(KINDS), N_BOXES), np.float32)
        cot[k] = 1.0
        for run in (_jax_run, _torch_run):
            outs, g1, g2 = run(b1, b2, "float32", cot)
            _close(_np(outs[k])[ok], per_box.detach()[ok], tol("float32"))
            _close(_np(g1)[ok], grads[0][ok], tol("float32"))
            _close(_np(g2)[ok], grads[1][ok], tol("float32"))
        for reduction in REDUCTIONS:
            expected = tv_loss(torch.tensor(b1[ok]), torch.tensor(b2[ok]),
                               reduction=reduction, eps=EPS)  # fmt: skip
            for lib in (jl, tl):
                out = lib.box_iou_loss(b1[ok], b2[ok], kind=kind, reduction=reduction)
                _close(out, expected, tol("float32"))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_focal_loss_matches_torchvision(reduction, tol):
    tv = pytest.importorskip("torchvision")
    xs, ts, _ = _focal_case("float32")
    xt = torch.tensor(xs[0], requires_grad=True)
    ref = tv.ops.sigmoid_focal_loss(xt, torch.tensor(ts[0]), reduction=reduction)
    ref.sum().backward()
    jax_out = _jax_focal(reduction)(xs, ts, np.ones(len(FOCAL_CONFIGS), np.float32))
    torch_out = _torch_focal(xs[0], ts[0], 0.25, 2.0, reduction, "float32", 1.0)
    for out, grad in (jax_out[0], torch_out):
        _close(out, ref, tol("float32"))
        _close(grad, xt.grad, tol("float32"))


# ---------------------------------------------------------------------------
# issue 21 (item 4): a degenerate box in a guarded train step
# ---------------------------------------------------------------------------

GOOD = np.array([[0.0, 0.0, 2.0, 2.0], [1.0, 1.0, 4.0, 3.0]], np.float32)
INVERTED = np.array([[0.0, 0.0, 2.0, 2.0], [4.0, 1.0, 1.0, 3.0]], np.float32)
TARGETS = np.array([[1.0, 1.0, 3.0, 3.0], [0.0, 1.0, 2.0, 5.0]], np.float32)


@functools.cache
def _jax_guarded_step():
    """The optimizer and a jitted guarded train step on predicted boxes (one
    of each: the step compiles once)."""
    import optax

    from jaxstable import train, transforms

    step = train.make_train_step(
        lambda p, b: jl.box_iou_loss(p, b, kind="giou", reduction="mean")
    )
    return transforms.stable_optimizer(optax.sgd(0.1)), step


def _jax_box_step(pred, target):
    """One guarded SGD step: (finite, skipped_total, new params)."""
    from jaxstable import train

    tx, step = _jax_guarded_step()
    state = train.TrainState.create(params=jnp.asarray(pred), optimizer=tx)
    state, metrics = step(state, jnp.asarray(target))
    return (
        bool(metrics["finite"]),
        int(metrics["skipped_total"]),
        np.asarray(state.params),
    )


def _torch_box_step(pred, target):
    from torchref import train

    model = torch.nn.Module()
    model.boxes = torch.nn.Parameter(torch.tensor(pred))
    step = train.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: tl.box_iou_loss(m.boxes, b, kind="giou", reduction="mean"),
    )
    metrics = step(torch.tensor(target))
    return metrics["finite"], metrics["skipped_total"], model.boxes.detach().numpy()


@pytest.mark.parametrize(
    "pred,target",
    [(INVERTED, TARGETS), (GOOD, TARGETS[:, [2, 1, 0, 3]])],
    ids=["predicted_box_inverted", "target_box_inverted"],
)
@pytest.mark.parametrize("run", [_jax_box_step, _torch_box_step])
def test_inverted_box_in_a_guarded_step_is_skipped_not_raised(run, pred, target):
    """Both twins: the bad pair's loss is NaN (JAX: traced boxes; torch: the
    predicted boxes require grad), the guard skips the step and counts it,
    the parameters are unchanged (torch used to raise mid-training). A
    plain eager call raises in both: test_loss_bad_inputs.py's table."""
    finite, skipped, params = run(pred, target)
    assert not finite and skipped == 1
    np.testing.assert_array_equal(params, pred)
    finite, skipped, params = run(GOOD, TARGETS)  # the same step, good boxes
    assert finite and skipped == 0 and not np.array_equal(params, GOOD)


def test_inverted_box_requiring_grad_is_nan_for_its_pair_only():
    """torch: a box tensor that requires grad is JAX's traced box: the
    inverted pair's loss and gradient are NaN, the other pair finite, every
    kind; JAX's eager jax.grad with concrete targets gives the same (CIoU,
    the kind with every term)."""
    target = torch.tensor(TARGETS)
    for kind in KINDS:
        boxes = torch.tensor(INVERTED, requires_grad=True)
        loss = tl.box_iou_loss(boxes, target, kind=kind)
        loss.sum().backward()
        assert np.isnan(loss[1].item()) and np.isfinite(loss[0].item()), kind
        assert boxes.grad[1].isnan().all() and boxes.grad[0].isfinite().all()
    value, grad = jax.value_and_grad(
        lambda b: jl.box_iou_loss(b, TARGETS, kind="ciou").sum()
    )(jnp.asarray(INVERTED))
    assert np.isnan(float(value)) and np.isnan(np.asarray(grad)[1]).all()
    assert np.isfinite(np.asarray(grad)[0]).all()
