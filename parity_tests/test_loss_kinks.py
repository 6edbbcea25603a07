"""Gradients at every kink and tie, and the precision rule (issue 22, items 1
and 12): jaxstable and torchref against the PyTorch reference formula.

Each case is a loss at inputs that sit exactly on a kink or a tie: a logit of
exactly 0 (a zero-initialised head), pred == target under ``abs``, a norm
exactly ``eps`` and a temperature exactly ``min_temperature`` (clamps), equal
hard negatives at the k-th place, all-equal logits, equal boxes and shared
edges, prob == thresh, one valid pixel, dtype limits, zero-size inputs. The
reference is what the PyTorch code these losses restate computes, with
torch's autograd, in float64 (``F.binary_cross_entropy_with_logits``,
DBNet's formulas, ``F.normalize``, torchvision's box and focal formulas): its
value and gradients are compared with both twins' in every dtype, float64
included (JAX with x64 on), where the precision rule says the loss computes
and returns float64. The float64 precision test moves the inputs off the
ties by ~1e-3 (values float32 cannot hold) and needs float64 agreement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tolerance
from jaxstable import losses as jl
from parity_tests.test_box_losses import _ref_box, _ref_focal
from torchref import losses as tl

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

DTYPES = ["float32", "bfloat16", "float16", "float64"]
KINDS = ["iou", "giou", "diou", "ciou"]


class Case(NamedTuple):
    """Differentiated inputs ``args`` (a dict of arrays, or a function of the
    dtype's finfo giving one), fixed inputs ``consts`` (targets, masks,
    labels) and three scalar losses of ``(**args, **consts)``: jaxstable's,
    torchref's and the float64 torch reference's."""

    args: dict | Callable
    consts: dict
    jax: Callable
    torch: Callable
    ref: Callable


# --------------------------------------------------------------------------
# float64 references (torch autograd on the PyTorch code's formulas)
# --------------------------------------------------------------------------


def _ref_balanced(logits, targets, mask, ratio=3.0, eps=1e-6):
    """DBNet's balanced BCE; the hardest negatives by a stable descending
    sort (the documented tie rule: torch.topk's choice is unspecified)."""
    pos = (targets > 0.5) & (mask > 0.5)
    neg = ~(targets > 0.5) & (mask > 0.5)
    loss = F.binary_cross_entropy_with_logits(logits, pos.double(), reduction="none")
    k = min(int(neg.sum()), int(np.float32(int(pos.sum())) * np.float32(ratio)))
    neg_loss = torch.where(neg, loss, torch.zeros_like(loss)).reshape(-1)
    hardest = torch.sort(neg_loss, descending=True, stable=True).values[:k]
    pos_sum = torch.where(pos, loss, torch.zeros_like(loss)).sum()
    return (pos_sum + hardest.sum()) / (int(pos.sum()) + k + eps)


def _ref_l1(pred, target, mask):
    """DBNet's MaskL1Loss: torch's abs, whose gradient at 0 is sign(0) = 0."""
    return (torch.abs(pred - target) * mask).sum() / mask.sum()


def _ref_dice(probs, targets, mask, eps=1e-6):
    p, g, m = probs, targets, mask
    return 1 - 2 * (p * g * m).sum() / ((p * m).sum() + (g * m).sum() + eps)


def _ref_step(x, y, k=50.0):
    return torch.reciprocal(1 + torch.exp(-k * (x - y)))  # DBNet's step


def _ref_db_loss(shrink_logits, thresh, gt, mask, thresh_map, thresh_mask):
    binary = _ref_step(torch.sigmoid(shrink_logits), thresh)
    return (
        5 * _ref_balanced(shrink_logits, gt, mask)
        + 10 * _ref_l1(thresh, thresh_map, thresh_mask)
        + _ref_dice(binary, gt, mask)
    )


def _ref_info_nce(a, b, temperature, min_temperature, eps):
    sim = F.normalize(a, dim=1, eps=eps) @ F.normalize(b, dim=1, eps=eps).T
    sim = sim / temperature.clamp(min=min_temperature)
    y = torch.arange(a.shape[0])
    return 0.5 * (F.cross_entropy(sim, y) + F.cross_entropy(sim.T, y))


def _ref_focal_mean(x, t, alpha, gamma):
    return _ref_focal(x, t, alpha, gamma).mean()


def _boxes_all_kinds(lib):
    """sum over the kinds of weight * box loss (one gradient checks all)."""

    def f(b1, b2):
        return sum(
            (i + 1) * lib.box_iou_loss(b1, b2, kind=kind, reduction="sum")
            for i, kind in enumerate(KINDS)
        )

    return f


def _ref_boxes_all_kinds(b1, b2):
    return sum((i + 1) * _ref_box(b1, b2, kind).sum() for i, kind in enumerate(KINDS))


def _empty(value):
    """The documented value on zero-size inputs, with empty gradients."""
    return lambda **a: sum(v.sum() * 0 for v in a.values()) + value


# --------------------------------------------------------------------------
# the cases (values exact in every dtype)
# --------------------------------------------------------------------------

# Every elementwise case has 16 elements: JAX's eager ops compile once per
# shape, so one shape keeps this file's compile time (most of its time) low.
T_BINARY = np.float32([1, 0, 1, 0, 0.25, 0.75, 1, 0, 0, 0, 1, 0.5, 0, 1, 0, 0])
ZERO_HEAD = np.zeros(16)
ZERO_HEAD[1] = -0.0  # a logit of -0.0 is on the kink too
# 16 pixels, 2 positives, one pixel outside the mask: 13 negatives, k = 6 of
# them, all tied at log 2 when the logits are 0
GT16 = np.zeros(16, np.float32)
GT16[[3, 9]] = 1.0
MASK16 = np.ones(16, np.float32)
MASK16[12] = 0.0
# one positive (ratio 3: k = 3) and four negatives tied at logit 1
TIED_X = np.array([3.0, 1.0, 1.0, -1.0, 1.0, 1.0, 0.5] + [-2.0] * 9)
TIED_GT = np.float32([1] + [0] * 15)
L1_PRED = np.tile([0.5, 0.25, 0.75, 0.5, 1.0, 0.0, 0.25, 0.125], 2)
L1_TARGET = np.tile([0.5, 0.5, 0.75, 0.25, 1.0, 0.0, 0.0, 0.125], 2)  # 5 ties
L1_MASK = np.float32(np.tile([1, 1, 1, 1, 0, 1, 1, 1], 2))
ONE_PIXEL = np.zeros(16, np.float32)
ONE_PIXEL[2] = 1.0
ONES16 = np.ones(16, np.float32)
# rows of norm exactly eps = 0.5 and 0, temperature == min_temperature
NCE_A = np.array([[0.5, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1], [0, -2, 1, 0]])
NCE_B = np.array([[1, 0, 0, 1], [0.25, 0.25, 0.25, 0.25], [0, 0, 0, 0], [2, 0, 1, 0]])
NCE = dict(min_temperature=0.25, eps=0.5)
# (x1, y1, x2, y2) pairs: equal boxes, shared left and top edges, touching
# edges (zero overlap), a shared corner; integers, exact in every dtype
BOX1 = np.array([[1, 2, 5, 4], [0, 0, 2, 2], [0, 0, 2, 2], [0, 0, 2, 2]], float)
BOX2 = np.array([[1, 2, 5, 4], [0, 0, 3, 1], [2, 0, 4, 2], [2, 2, 4, 4]], float)
CE_LABELS = np.array([0, 2, 1, 255])
CE_W = np.float32([0.5, 2.0, 1.0])


T_LIMITS = np.zeros(16, np.float32)
T_LIMITS[[2, 3]] = [1.0, 0.5]


def _limits(finfo):
    """A logit at the dtype's max with the wrong target (T_LIMITS), at -max
    with the right one, at 0 and at the smallest normal number."""
    x = np.zeros(16)
    x[:4] = [finfo.max, -finfo.max, 0.0, finfo.tiny]
    return {"x": x}


CASES = {
    "bce_logit_zero": Case(
        {"x": ZERO_HEAD},
        {"t": T_BINARY},
        lambda x, t: jl.sigmoid_binary_cross_entropy(x, t),
        lambda x, t: tl.sigmoid_binary_cross_entropy(x, t),
        lambda x, t: F.binary_cross_entropy_with_logits(x, t),
    ),
    "bce_logit_zero_weighted_sum": Case(
        {"x": ZERO_HEAD},
        {"t": T_BINARY, "w": np.float32(np.tile([0.5, 2, 1, 3, 1, 0.25, 1, 2], 2))},
        lambda x, t, w: jl.sigmoid_binary_cross_entropy(
            x, t, weights=w, reduction="sum"
        ),
        lambda x, t, w: tl.sigmoid_binary_cross_entropy(
            x, t, weights=w, reduction="sum"
        ),
        lambda x, t, w: F.binary_cross_entropy_with_logits(
            x, t, weight=w, reduction="sum"
        ),
    ),
    "bce_dtype_limits": Case(
        _limits,
        {"t": T_LIMITS},
        lambda x, t: jl.sigmoid_binary_cross_entropy(x, t),
        lambda x, t: tl.sigmoid_binary_cross_entropy(x, t),
        lambda x, t: F.binary_cross_entropy_with_logits(x, t),
    ),
    "focal_logit_zero": Case(
        {"x": ZERO_HEAD},
        {"t": T_BINARY},
        lambda x, t: jl.sigmoid_focal_loss(x, t, reduction="mean"),
        lambda x, t: tl.sigmoid_focal_loss(x, t, reduction="mean"),
        lambda x, t: _ref_focal_mean(x, t, 0.25, 2.0),
    ),
    "focal_logit_zero_soft_unweighted": Case(
        {"x": ZERO_HEAD},
        {"t": T_BINARY},
        lambda x, t: jl.sigmoid_focal_loss(x, t, alpha=None, gamma=1.5).mean(),
        lambda x, t: tl.sigmoid_focal_loss(x, t, alpha=None, gamma=1.5).mean(),
        lambda x, t: _ref_focal_mean(x, t, None, 1.5),
    ),
    "balanced_bce_zero_head_tied_negatives": Case(
        {"logits": np.zeros(16)},
        {"targets": GT16, "mask": MASK16},
        jl.balanced_binary_cross_entropy,
        tl.balanced_binary_cross_entropy,
        _ref_balanced,
    ),
    "balanced_bce_tied_hard_negatives": Case(
        {"logits": TIED_X},
        {"targets": TIED_GT, "mask": ONES16},
        jl.balanced_binary_cross_entropy,
        tl.balanced_binary_cross_entropy,
        _ref_balanced,
    ),
    "masked_l1_pred_equals_target": Case(
        {"pred": L1_PRED, "target": L1_TARGET},
        {"mask": L1_MASK},
        jl.masked_l1_loss,
        tl.masked_l1_loss,
        _ref_l1,
    ),
    "masked_l1_one_valid_pixel_tie": Case(
        {"pred": L1_PRED, "target": L1_PRED},
        {"mask": ONE_PIXEL},
        jl.masked_l1_loss,
        tl.masked_l1_loss,
        _ref_l1,
    ),
    "dice_one_valid_pixel": Case(
        {"probs": np.tile([0.25, 0.5, 1.0, 0.75], 4)},
        {"targets": np.float32(np.tile([1, 0, 1, 0], 4)), "mask": ONE_PIXEL},
        jl.dice_loss,
        tl.dice_loss,
        _ref_dice,
    ),
    "db_step_prob_equals_thresh": Case(
        {
            "x": np.tile([0.5, 0.25, 1.0, 0.0, 1.0, 0.0, 0.75, 0.5], 2),
            "y": np.tile([0.5, 0.25, 1.0, 0.0, 0.0, 1.0, 0.75, 0.25], 2),
        },
        {},
        lambda x, y: jl.db_step(x, y).sum(),
        lambda x, y: tl.db_step(x, y).sum(),
        lambda x, y: _ref_step(x, y).sum(),
    ),
    "db_loss_zero_head": Case(
        # sigmoid(0) = 0.5 = thresh = thresh_map: BCE, L1 and step ties at once
        {"shrink_logits": np.zeros(16), "thresh": np.full(16, 0.5)},
        {"gt": GT16, "mask": ONES16, "thresh_map": 0.5 * ONES16, "thresh_mask": ONES16},
        jl.db_loss,
        tl.db_loss,
        _ref_db_loss,
    ),
    "info_nce_norm_eps_zero_row_temperature_floor": Case(
        {"a": NCE_A, "b": NCE_B, "temperature": np.array(0.25)},
        {},
        lambda a, b, temperature: jl.info_nce(a, b, temperature=temperature, **NCE),
        lambda a, b, temperature: tl.info_nce(a, b, temperature=temperature, **NCE),
        lambda a, b, temperature: _ref_info_nce(a, b, temperature, **NCE),
    ),
    "ce_all_equal_logits": Case(
        {"x": np.zeros((4, 3))},
        {"y": CE_LABELS, "w": CE_W},
        lambda x, y, w: jl.softmax_cross_entropy(
            x, y, ignore_index=255, label_smoothing=0.1, weights=w
        ),
        lambda x, y, w: tl.softmax_cross_entropy(
            x, y, ignore_index=255, label_smoothing=0.1, weights=w
        ),
        lambda x, y, w: F.cross_entropy(
            x, y, ignore_index=255, label_smoothing=0.1, weight=w
        ),
    ),
    "ce_one_valid_pixel": Case(
        {"x": np.zeros((4, 3))},
        {"y": np.array([255, 255, 1, 255])},
        lambda x, y: jl.softmax_cross_entropy(x, y, ignore_index=255),
        lambda x, y: tl.softmax_cross_entropy(x, y, ignore_index=255),
        lambda x, y: F.cross_entropy(x, y, ignore_index=255),
    ),
    "box_equal_shared_and_touching_edges": Case(
        {"b1": BOX1, "b2": BOX2},
        {},
        _boxes_all_kinds(jl),
        _boxes_all_kinds(tl),
        _ref_boxes_all_kinds,
    ),
    # zero-size inputs: the documented value (0.0, dice 1.0), empty gradients
    # (torch's own mean of nothing is NaN)
    "bce_zero_size": Case(
        {"logits": np.zeros((0, 3))},
        {"targets": np.zeros((0, 3), np.float32)},
        jl.sigmoid_binary_cross_entropy,
        tl.sigmoid_binary_cross_entropy,
        _empty(0.0),
    ),
    "balanced_bce_zero_size": Case(
        {"logits": np.zeros((0,))},
        {"targets": np.zeros(0, np.float32), "mask": np.zeros(0, np.float32)},
        jl.balanced_binary_cross_entropy,
        tl.balanced_binary_cross_entropy,
        _empty(0.0),
    ),
    "dice_zero_size": Case(
        {"probs": np.zeros((2, 0))},
        {"targets": np.zeros((2, 0), np.float32)},
        jl.dice_loss,
        tl.dice_loss,
        _empty(1.0),
    ),
    "masked_l1_zero_size": Case(
        {"pred": np.zeros((0, 4)), "target": np.zeros((0, 4))},
        {"mask": np.zeros((0, 4), np.float32)},
        jl.masked_l1_loss,
        tl.masked_l1_loss,
        _empty(0.0),
    ),
    "focal_zero_size": Case(
        {"x": np.zeros((0,))},
        {"t": np.zeros(0, np.float32)},
        lambda x, t: jl.sigmoid_focal_loss(x, t, reduction="mean"),
        lambda x, t: tl.sigmoid_focal_loss(x, t, reduction="mean"),
        _empty(0.0),
    ),
}
# (zero-size CE and boxes: test_losses.py::test_ce_all_ignored_and_empty_are_
# zero_with_zero_grad and test_box_losses.py::test_empty_boxes_every_reduction)


# --------------------------------------------------------------------------
# runners
# --------------------------------------------------------------------------


def _finfo(dtype):
    return jnp.finfo(dtype) if dtype != "float64" else np.finfo(np.float64)


def _inputs(case, dtype, shift=0.0):
    """The case's differentiated inputs as float64 values exact in dtype
    (moved by ~shift, off the ties, for the precision test)."""
    args = case.args(_finfo(dtype)) if callable(case.args) else case.args
    rng = np.random.default_rng(0)
    out = {}
    for name, value in args.items():
        value = np.asarray(value, np.float64)
        value = value + shift * rng.uniform(0.5, 1.0, value.shape)
        if dtype != "float64":
            value = np.asarray(
                jnp.asarray(value.astype(np.float32)).astype(dtype).astype(jnp.float32),
                np.float64,
            )
        out[name] = value
    return out


def _x64(dtype):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def _run_jax(case, args, dtype):
    """(value, {name: gradient}) as float64 numpy, after checking dtypes."""
    out_dtype = "float64" if dtype == "float64" else "float32"
    with _x64(dtype):
        xs = {k: jnp.asarray(v).astype(dtype) for k, v in args.items()}
        consts = {k: jnp.asarray(v) for k, v in case.consts.items()}
        value, grads = jax.value_and_grad(lambda a: case.jax(**a, **consts))(xs)
        assert value.dtype == jnp.dtype(out_dtype), value.dtype
        assert all(g.dtype == jnp.dtype(dtype) for g in grads.values())
        grads = {
            k: np.asarray(g.astype(out_dtype), np.float64) for k, g in grads.items()
        }
        return float(value), grads


def _run_torch(case, args, dtype):
    out_dtype = getattr(torch, "float64" if dtype == "float64" else "float32")
    xs = {
        k: torch.tensor(v).to(getattr(torch, dtype)).requires_grad_()
        for k, v in args.items()
    }
    consts = {k: torch.as_tensor(v) for k, v in case.consts.items()}
    value = case.torch(**xs, **consts)
    assert value.dtype == out_dtype, value.dtype
    value.backward()
    assert all(v.grad.dtype == getattr(torch, dtype) for v in xs.values())
    return value.item(), {k: v.grad.double().numpy() for k, v in xs.items()}


def _run_ref(case, args):
    xs = {k: torch.tensor(v, requires_grad=True) for k, v in args.items()}
    consts = {
        k: torch.as_tensor(v).double() if v.dtype.kind == "f" else torch.as_tensor(v)
        for k, v in case.consts.items()
    }
    value = case.ref(**xs, **consts)
    grads = torch.autograd.grad(value, list(xs.values()), allow_unused=True)
    return value.item(), {
        k: np.zeros(v.shape) if g is None else g.numpy()
        for (k, v), g in zip(xs.items(), grads, strict=True)
    }


def _compare(case, args, dtype):
    value_tol = tolerance("float64" if dtype == "float64" else "float32")
    ref_value, ref_grads = _run_ref(case, args)
    for run in (_run_jax, _run_torch):
        value, grads = run(case, args, dtype)
        np.testing.assert_allclose(value, ref_value, **value_tol, err_msg=run.__name__)
        for name, grad in grads.items():
            np.testing.assert_allclose(
                grad, ref_grads[name], **tolerance(dtype),
                err_msg=f"{run.__name__}: d/d{name}",
            )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES[:3])
@pytest.mark.parametrize("name", list(CASES))
def test_ties_at_every_kink(name, dtype):
    """Value and gradients of both twins equal the reference's, on the
    kink, in fp32, bf16 and fp16 (float64: the precision test below)."""
    _compare(CASES[name], _inputs(CASES[name], dtype), dtype)


@pytest.mark.parametrize("name", [n for n in CASES if not n.endswith("zero_size")])
def test_float64_inputs_compute_in_float64(name):
    """The precision rule: float64 predictions compute and return float64 in
    both twins (JAX with x64 on), value and gradients equal to the float64
    reference to float64 tolerance, on the ties and off them (moved by
    ~1e-3: values a float32 computation would round)."""
    case = CASES[name]
    _compare(case, _inputs(case, "float64"), "float64")
    _compare(case, _inputs(case, "float64", shift=1e-3), "float64")


# --------------------------------------------------------------------------
# the numbers of the issue
# --------------------------------------------------------------------------


def test_issue_numbers_at_logit_zero():
    """Targets [1, 0, 1, 0] at logits 0: the mean BCE's gradient is
    (sigmoid(0) - t) / 4 = [-0.125, 0.125, -0.125, 0.125] (was [-0.25, 0,
    -0.25, 0] in JAX); the focal loss' at gamma 2, alpha 0.25, t = 1 is
    -0.0746 (was -0.1058), in both twins."""
    t = np.float32([1, 0, 1, 0])
    expected = np.float32([-0.125, 0.125, -0.125, 0.125])
    g = jax.grad(jl.sigmoid_binary_cross_entropy)(jnp.zeros(4), t)
    x = torch.zeros(4, requires_grad=True)
    tl.sigmoid_binary_cross_entropy(x, torch.tensor(t)).backward()
    np.testing.assert_array_equal(np.asarray(g), expected)
    np.testing.assert_array_equal(x.grad.numpy(), expected)
    # alpha (2 q q' bce + q^2 bce') at q = 1/2, q' = -1/4, bce = ln 2, bce' = -1/2
    focal = -0.25 * (0.25 * np.log(2.0) + 0.125)
    assert round(focal, 4) == -0.0746
    ones = np.ones(16, np.float32)  # 16: the shape of CASES (compiled once)
    g = jax.grad(lambda v: jl.sigmoid_focal_loss(v, ones).sum())(jnp.zeros(16))
    x = torch.zeros(16, requires_grad=True)
    tl.sigmoid_focal_loss(x, torch.tensor(ones)).sum().backward()
    np.testing.assert_allclose(np.asarray(g), focal, **tolerance("float32"))
    np.testing.assert_allclose(x.grad.numpy(), focal, **tolerance("float32"))


HEAD_LOSSES = {
    "bce": (jl.sigmoid_binary_cross_entropy, tl.sigmoid_binary_cross_entropy),
    "focal": (
        lambda x, t: jl.sigmoid_focal_loss(x, t, reduction="mean"),
        lambda x, t: tl.sigmoid_focal_loss(x, t, reduction="mean"),
    ),
    "balanced_bce": (
        lambda x, t: jl.balanced_binary_cross_entropy(x, t, MASK16),
        lambda x, t: tl.balanced_binary_cross_entropy(x, t, torch.tensor(MASK16)),
    ),
}


@pytest.mark.parametrize("loss", list(HEAD_LOSSES))
def test_zero_initialised_head_first_step(loss):
    """A zero-initialised linear head puts every logit exactly at 0 on its
    first step: dL/dW and dL/db are the same in both twins (and, for the
    BCE, the analytic X^T (sigmoid(0) - t) / N)."""
    rng = np.random.default_rng(1)
    features = rng.normal(size=(16, 5)).astype(np.float32)
    jax_loss, torch_loss = HEAD_LOSSES[loss]

    def jax_head(params):
        return jax_loss(features @ params["w"] + params["b"], GT16)

    jg = jax.grad(jax_head)({"w": jnp.zeros(5), "b": jnp.zeros(())})
    head = torch.nn.Linear(5, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    torch_loss(head(torch.tensor(features))[:, 0], torch.tensor(GT16)).backward()
    tol = tolerance("float32")
    np.testing.assert_allclose(np.asarray(jg["w"]), head.weight.grad[0].numpy(), **tol)
    np.testing.assert_allclose(float(jg["b"]), head.bias.grad.item(), **tol)
    if loss == "bce":
        analytic = features.T.astype(np.float64) @ (0.5 - GT16) / 16
        np.testing.assert_allclose(np.asarray(jg["w"]), analytic, **tol)
