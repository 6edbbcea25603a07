"""The table of bad inputs: each one gets a clear error, the reference value, or
NaN (never a finite wrong number), in both frameworks (same case names, same
messages where the rule is shared). The cases are stated once and run against
both frameworks; JIT_CASES run JAX under jit, where a traced bad value cannot
raise and must make the loss and its gradient NaN. Limits that cannot be
changed are documented by tests of their own at the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tolerance
from jaxstable import losses as jl
from torchref import losses as tl

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 3, 5)).astype(np.float32)  # JAX: NHWC-like, classes last
Y = RNG.integers(0, 5, size=(2, 3))
P = RNG.random((2, 4)).astype(np.float32)
T = (RNG.random((2, 4)) < 0.5).astype(np.float32)
X_NAN = X.copy()
X_NAN[1, 2, 3] = np.nan
P_NAN = P.copy()
P_NAN[0, 1] = np.nan


def j(a):
    return jnp.asarray(a)


def t(a):
    return torch.tensor(np.asarray(a))


def xt():  # torch: NCHW-like, classes at dim 1
    return t(np.moveaxis(X, -1, 1).copy())


def _bad_labels(y):
    y = np.array(y)
    y[0, 0], y[1, 2] = 7, -3
    return y


# (case id, jax call, torch call, expected): expected is ("raises", type, regex)
# or ("nan",) or ("equals", value)
CASES = [
    (
        "ce_label_out_of_range",
        lambda: jl.softmax_cross_entropy(j(X), j(_bad_labels(Y))),
        lambda: tl.softmax_cross_entropy(xt(), t(_bad_labels(Y))),
        (
            "raises",
            ValueError,
            r"labels must be in \[0, 5\).*2 element\(s\).*\[-3, 7\]",
        ),
    ),
    (
        "ce_label_out_of_range_not_ignore_index",
        lambda: jl.softmax_cross_entropy(j(X), j(_bad_labels(Y)), ignore_index=7),
        lambda: tl.softmax_cross_entropy(xt(), t(_bad_labels(Y)), ignore_index=7),
        ("raises", ValueError, r"not ignore_index=7.*1 element\(s\).*\[-3\]"),
    ),
    (
        "ce_float_labels",
        lambda: jl.softmax_cross_entropy(j(X), j(Y.astype(np.float32))),
        lambda: tl.softmax_cross_entropy(xt(), t(Y.astype(np.float32))),
        (
            "raises",
            TypeError,
            r"labels must be an integer .* got dtype (torch\.)?float32",
        ),
    ),
    (
        "ce_labels_wrong_shape",
        lambda: jl.softmax_cross_entropy(j(X), j(Y[:, :2])),
        lambda: tl.softmax_cross_entropy(xt(), t(Y[:, :2])),
        ("raises", ValueError, r"labels\.shape=\(2, 2\) must equal logits\.shape="),
    ),
    (
        "ce_integer_logits",
        lambda: jl.softmax_cross_entropy(j(Y[..., None] * np.ones(5, int)), j(Y)),
        lambda: tl.softmax_cross_entropy(
            t(Y[:, None, :] * np.ones((1, 5, 1), int)), t(Y)
        ),
        ("raises", TypeError, r"logits must be a floating"),
    ),
    (
        "ce_nan_logits",
        lambda: jl.softmax_cross_entropy(j(X_NAN), j(Y)),
        lambda: tl.softmax_cross_entropy(t(np.moveaxis(X_NAN, -1, 1).copy()), t(Y)),
        ("nan",),
    ),
    (
        "ce_empty_batch_mean",
        lambda: jl.softmax_cross_entropy(j(X[:0]), j(Y[:0])),
        lambda: tl.softmax_cross_entropy(t(np.moveaxis(X[:0], -1, 1).copy()), t(Y[:0])),
        ("equals", 0.0),
    ),
    (
        "ce_label_smoothing_above_1",
        lambda: jl.softmax_cross_entropy(j(X), j(Y), label_smoothing=1.5),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), label_smoothing=1.5),
        ("raises", ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
    ),
    (
        "ce_label_smoothing_negative",
        lambda: jl.softmax_cross_entropy(j(X), j(Y), label_smoothing=-0.1),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), label_smoothing=-0.1),
        ("raises", ValueError, r"label_smoothing must be in \[0, 1\], got -0.1"),
    ),
    (
        "ce_unknown_reduction",
        lambda: jl.softmax_cross_entropy(j(X), j(Y), reduction="avg"),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), reduction="avg"),
        (
            "raises",
            ValueError,
            r"unknown reduction 'avg'; valid values: mean, sum, none",
        ),
    ),
    (
        "ce_weights_wrong_length",
        lambda: jl.softmax_cross_entropy(j(X), j(Y), weights=jnp.ones(4)),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), weights=torch.ones(4)),
        ("raises", ValueError, r"weights must have shape \(5,\).*got \(4,\)"),
    ),
    (
        "ce_class_axis_out_of_range",
        lambda: jl.softmax_cross_entropy(j(X), j(Y), axis=3),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), dim=3),
        ("raises", ValueError, r"=3 is out of range for logits with 3 dims"),
    ),
    (
        "bce_targets_wrong_shape",
        lambda: jl.sigmoid_binary_cross_entropy(j(P), j(T[:, :3])),
        lambda: tl.sigmoid_binary_cross_entropy(t(P), t(T[:, :3])),
        ("raises", ValueError, r"logits\.shape=\(2, 4\) and targets\.shape=\(2, 3\)"),
    ),
    (
        "bce_unknown_reduction",
        lambda: jl.sigmoid_binary_cross_entropy(j(P), j(T), reduction="mean_all"),
        lambda: tl.sigmoid_binary_cross_entropy(t(P), t(T), reduction="mean_all"),
        ("raises", ValueError, r"valid values: mean, sum, none"),
    ),
    (
        "bce_weights_do_not_broadcast",
        lambda: jl.sigmoid_binary_cross_entropy(j(P), j(T), weights=jnp.ones(3)),
        lambda: tl.sigmoid_binary_cross_entropy(t(P), t(T), weights=torch.ones(3)),
        ("raises", ValueError, r"weights\.shape=\(3,\) does not broadcast"),
    ),
    (
        "bce_nan_logits",
        lambda: jl.sigmoid_binary_cross_entropy(j(P_NAN), j(T)),
        lambda: tl.sigmoid_binary_cross_entropy(t(P_NAN), t(T)),
        ("nan",),
    ),
    (
        "balanced_bce_negative_ratio_zero",
        lambda: jl.balanced_binary_cross_entropy(j(P), j(T), j(T), negative_ratio=0),
        lambda: tl.balanced_binary_cross_entropy(t(P), t(T), t(T), negative_ratio=0),
        ("raises", ValueError, r"negative_ratio must be > 0, got 0"),
    ),
    (
        "balanced_bce_mask_wrong_shape",
        lambda: jl.balanced_binary_cross_entropy(j(P), j(T), j(T[:1])),
        lambda: tl.balanced_binary_cross_entropy(t(P), t(T), t(T[:1])),
        ("raises", ValueError, r"mask\.shape=\(1, 4\)"),
    ),
    (
        "dice_mask_wrong_shape",
        lambda: jl.dice_loss(j(P), j(T), j(T.T)),
        lambda: tl.dice_loss(t(P), t(T), t(T.T.copy())),
        ("raises", ValueError, r"probs\.shape=\(2, 4\) and mask\.shape=\(4, 2\)"),
    ),
    (
        "dice_eps_zero",
        lambda: jl.dice_loss(j(P), j(T), eps=0.0),
        lambda: tl.dice_loss(t(P), t(T), eps=0.0),
        ("raises", ValueError, r"eps must be > 0"),
    ),
    (
        "masked_l1_mask_wrong_shape",
        lambda: jl.masked_l1_loss(j(P), j(T), j(T[0])),
        lambda: tl.masked_l1_loss(t(P), t(T), t(T[0])),
        ("raises", ValueError, r"pred\.shape=\(2, 4\) and mask\.shape=\(4,\)"),
    ),
    (
        "db_step_k_zero",
        lambda: jl.db_step(j(P), j(T), k=0.0),
        lambda: tl.db_step(t(P), t(T), k=0.0),
        ("raises", ValueError, r"k must be > 0, got 0.0"),
    ),
    (
        "db_step_k_negative",
        lambda: jl.db_step(j(P), j(T), k=-50.0),
        lambda: tl.db_step(t(P), t(T), k=-50.0),
        ("raises", ValueError, r"k must be > 0, got -50.0"),
    ),
    (
        "info_nce_negative_temperature",
        lambda: jl.info_nce(j(P), j(P), temperature=-0.07),
        lambda: tl.info_nce(t(P), t(P), temperature=-0.07),
        ("raises", ValueError, r"temperature must be > 0, got -0.07"),
    ),
    (
        "info_nce_shape_mismatch",
        lambda: jl.info_nce(j(P), j(P[:, :3])),
        lambda: tl.info_nce(t(P), t(P[:, :3])),
        ("raises", ValueError, r"a\.shape=\(2, 4\) and b\.shape=\(2, 3\)"),
    ),
    (
        "info_nce_empty_batch",
        lambda: jl.info_nce(j(P[:0]), j(P[:0])),
        lambda: tl.info_nce(t(P[:0]), t(P[:0])),
        ("raises", ValueError, r"at least one pair, got N=0"),
    ),
    (
        "info_nce_not_2d",
        lambda: jl.info_nce(j(P[0]), j(P[0])),
        lambda: tl.info_nce(t(P[0]), t(P[0])),
        ("raises", ValueError, r"a must have shape \(N, D\), got a\.shape=\(4,\)"),
    ),
]
# ---------------------------------------------------------------------------
# issue 14: no finite wrong number. Same format; a call of None means the case
# does not exist in that framework (devices: torch only), and an expected
# ("ref", f) is the reference value f() computes (torch's F.* in float64).
# ---------------------------------------------------------------------------

C0, C1 = int(Y[0, 0]), int(Y[1, 0])  # two classes present in Y (4 and 1)


def _weights(values):
    w = np.zeros(5, np.float32)
    for cls, v in values.items():
        w[cls] = v
    return w


def _count(cls):
    return int((Y == cls).sum())


# sum over the labels: -10 * #C0 + (6 - #C0) < 0
W_NEGATIVE_SUM = np.where(np.arange(5) == C0, -10.0, 1.0).astype(np.float32)
# #C1 * #C0 - #C0 * #C1 == 0 exactly, with valid elements
W_ZERO_SUM = _weights({C0: _count(C1), C1: -_count(C0)})


def _ref_ce(w, smoothing=0.0, x=X):
    """F.cross_entropy in float64: the reference value."""
    return F.cross_entropy(
        torch.tensor(np.moveaxis(x, -1, 1), dtype=torch.float64),
        torch.tensor(Y),
        weight=torch.tensor(w, dtype=torch.float64),
        label_smoothing=smoothing,
    ).item()


def _ref_ce_plain(x):
    return F.cross_entropy(
        torch.tensor(np.moveaxis(x, -1, 1), dtype=torch.float64), torch.tensor(Y)
    ).item()


Y_INT64_WRAPS = np.array(Y)
Y_INT64_WRAPS[0, 1] = 2**32 + 1  # int32 wrap: 1, a valid class
X_MINUS_INF = X.copy()
X_MINUS_INF[0, 0, (C0 + 1) % 5] = -np.inf  # not the label: probability 0
X_PLUS_INF = X.copy()
X_PLUS_INF[0, 0, (C0 + 1) % 5] = np.inf

# OHEM: one positive, ratio 2 -> k = 2 of 4 negatives; the NaN is not among
# the two largest finite negative losses, so a sort that puts NaN last drops it
L_OHEM = np.array([2.0, -1.0, 3.0, np.nan, 0.0], np.float32)
G_OHEM = np.array([1.0, 0.0, 0.0, 0.0, 0.0], np.float32)
M_OHEM = np.ones(5, np.float32)
L_FINITE = np.nan_to_num(L_OHEM)
L_MINUS_INF = np.where(np.isnan(L_OHEM), -np.inf, L_OHEM).astype(np.float32)
G_NAN = G_OHEM.copy()
G_NAN[2] = np.nan
M_NAN = M_OHEM.copy()
M_NAN[4] = np.nan
M_NEGATIVE = np.ones((2, 4), np.float32)
M_NEGATIVE[1, 1] = -1.0


def _ref_ohem_all_negatives():
    """Every negative kept: (sum of all BCE terms) / (#pos + #neg + eps)."""
    x = L_FINITE.astype(np.float64)
    bce = np.maximum(x, 0) - x * G_OHEM + np.log1p(np.exp(-np.abs(x)))
    return bce.sum() / (5 + 1e-6)


def _ref_l1():
    return float(np.abs(P.astype(np.float64) - T).mean())


def _ref_info_nce():
    a = torch.tensor(P, dtype=torch.float64)
    a = F.normalize(a, dim=1)
    s = a @ a.T / 0.07
    y = torch.arange(2)
    return (0.5 * (F.cross_entropy(s, y) + F.cross_entropy(s.T, y))).item()


def _meta(a):
    return torch.empty(np.shape(a), device="meta")


DEVICES = r"all inputs must be on one device, got .*{} on meta"

CASES += [
    (
        "ce_int64_label_beyond_int32",
        lambda: jl.softmax_cross_entropy(j(X), Y_INT64_WRAPS),
        lambda: tl.softmax_cross_entropy(xt(), t(Y_INT64_WRAPS)),
        ("raises", ValueError, r"labels must be in \[0, 5\).*\[4294967297\]"),
    ),
    (
        "ce_python_int_label_beyond_int32",
        lambda: jl.softmax_cross_entropy(j(X[0, 0]), 2**40),
        lambda: tl.softmax_cross_entropy(t(X[0, 0]), 2**40, dim=0),
        ("raises", ValueError, r"labels must be in \[0, 5\).*\[1099511627776\]"),
    ),
    (
        "ce_weights_negative_sum",
        lambda: jl.softmax_cross_entropy(j(X), j(Y), weights=j(W_NEGATIVE_SUM)),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), weights=t(W_NEGATIVE_SUM)),
        ("ref", lambda: _ref_ce(W_NEGATIVE_SUM)),
    ),
    (
        "ce_weights_negative_sum_smoothing",
        lambda: jl.softmax_cross_entropy(
            j(X), j(Y), weights=j(W_NEGATIVE_SUM), label_smoothing=0.2
        ),
        lambda: tl.softmax_cross_entropy(
            xt(), t(Y), weights=t(W_NEGATIVE_SUM), label_smoothing=0.2
        ),
        ("ref", lambda: _ref_ce(W_NEGATIVE_SUM, 0.2)),
    ),
    (
        "ce_weights_zero_sum",  # F.cross_entropy: x / 0 (+-inf or NaN)
        lambda: jl.softmax_cross_entropy(j(X), j(Y), weights=j(W_ZERO_SUM)),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), weights=t(W_ZERO_SUM)),
        ("nan",),
    ),
    (
        "ce_weights_zero_sum_smoothing",
        lambda: jl.softmax_cross_entropy(
            j(X), j(Y), weights=j(W_ZERO_SUM), label_smoothing=0.2
        ),
        lambda: tl.softmax_cross_entropy(
            xt(), t(Y), weights=t(W_ZERO_SUM), label_smoothing=0.2
        ),
        ("nan",),
    ),
    (
        "ce_weights_all_zero",  # F.cross_entropy: 0 / 0
        lambda: jl.softmax_cross_entropy(j(X), j(Y), weights=jnp.zeros(5)),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), weights=torch.zeros(5)),
        ("nan",),
    ),
    (
        "ce_minus_inf_logit_not_the_label",  # an exact zero probability
        lambda: jl.softmax_cross_entropy(j(X_MINUS_INF), j(Y)),
        lambda: tl.softmax_cross_entropy(
            t(np.moveaxis(X_MINUS_INF, -1, 1).copy()), t(Y)
        ),
        ("ref", lambda: _ref_ce_plain(X_MINUS_INF)),
    ),
    (
        "ce_plus_inf_logit",
        lambda: jl.softmax_cross_entropy(j(X_PLUS_INF), j(Y)),
        lambda: tl.softmax_cross_entropy(
            t(np.moveaxis(X_PLUS_INF, -1, 1).copy()), t(Y)
        ),
        ("nan",),
    ),
    (
        "ce_numpy_and_list_inputs",  # converted, as jnp.asarray / torch.as_tensor
        lambda: jl.softmax_cross_entropy(X, Y.tolist()),
        lambda: tl.softmax_cross_entropy(np.moveaxis(X, -1, 1), Y.tolist()),
        ("ref", lambda: _ref_ce_plain(X)),
    ),
    (
        "ce_string_labels",
        lambda: jl.softmax_cross_entropy(j(X), "cat"),
        lambda: tl.softmax_cross_entropy(xt(), "cat"),
        ("raises", TypeError, r"labels must be a.* array-like .*got str"),
    ),
    (
        "balanced_bce_nan_logit_on_negative_pixel",  # torch.topk ranks it first
        lambda: jl.balanced_binary_cross_entropy(
            j(L_OHEM), j(G_OHEM), j(M_OHEM), negative_ratio=2.0
        ),
        lambda: tl.balanced_binary_cross_entropy(
            t(L_OHEM), t(G_OHEM), t(M_OHEM), negative_ratio=2.0
        ),
        ("nan",),
    ),
    (
        "balanced_bce_minus_inf_logit_on_negative_pixel",  # -inf * 0 in the BCE
        lambda: jl.balanced_binary_cross_entropy(
            j(L_MINUS_INF), j(G_OHEM), j(M_OHEM), negative_ratio=2.0
        ),
        lambda: tl.balanced_binary_cross_entropy(
            t(L_MINUS_INF), t(G_OHEM), t(M_OHEM), negative_ratio=2.0
        ),
        ("nan",),
    ),
    (
        "balanced_bce_nan_target_in_mask",  # neither positive nor negative
        lambda: jl.balanced_binary_cross_entropy(j(L_FINITE), j(G_NAN), j(M_OHEM)),
        lambda: tl.balanced_binary_cross_entropy(t(L_FINITE), t(G_NAN), t(M_OHEM)),
        ("nan",),
    ),
    (
        "balanced_bce_nan_mask",
        lambda: jl.balanced_binary_cross_entropy(j(L_FINITE), j(G_OHEM), j(M_NAN)),
        lambda: tl.balanced_binary_cross_entropy(t(L_FINITE), t(G_OHEM), t(M_NAN)),
        ("nan",),
    ),
    (
        "balanced_bce_negative_ratio_inf",  # torch: OverflowError in math.floor
        lambda: jl.balanced_binary_cross_entropy(
            j(P), j(T), j(T), negative_ratio=float("inf")
        ),
        lambda: tl.balanced_binary_cross_entropy(
            t(P), t(T), t(T), negative_ratio=float("inf")
        ),
        ("raises", ValueError, r"negative_ratio must be a finite number > 0, got inf"),
    ),
    (
        "balanced_bce_negative_ratio_nan",
        lambda: jl.balanced_binary_cross_entropy(
            j(P), j(T), j(T), negative_ratio=float("nan")
        ),
        lambda: tl.balanced_binary_cross_entropy(
            t(P), t(T), t(T), negative_ratio=float("nan")
        ),
        ("raises", ValueError, r"negative_ratio must be a finite number > 0, got nan"),
    ),
    (
        "balanced_bce_negative_ratio_beyond_int32",  # keeps every negative
        lambda: jl.balanced_binary_cross_entropy(
            j(L_FINITE), j(G_OHEM), j(M_OHEM), negative_ratio=1e30
        ),
        lambda: tl.balanced_binary_cross_entropy(
            t(L_FINITE), t(G_OHEM), t(M_OHEM), negative_ratio=1e30
        ),
        ("ref", _ref_ohem_all_negatives),
    ),
    (
        "balanced_bce_negative_ratio_not_scalar",
        lambda: jl.balanced_binary_cross_entropy(
            j(P), j(T), j(T), negative_ratio=np.array([3.0, 1.0])
        ),
        lambda: tl.balanced_binary_cross_entropy(
            t(P), t(T), t(T), negative_ratio=np.array([3.0, 1.0])
        ),
        ("raises", ValueError, r"negative_ratio must be a scalar, got shape \(2,\)"),
    ),
    (
        "masked_l1_negative_mask",
        lambda: jl.masked_l1_loss(j(P), j(T), j(M_NEGATIVE)),
        lambda: tl.masked_l1_loss(t(P), t(T), t(M_NEGATIVE)),
        ("raises", ValueError, r"mask must be >= 0 .*1 negative value.*-1\.0"),
    ),
    (
        "masked_l1_list_inputs",
        lambda: jl.masked_l1_loss(P.tolist(), T.tolist(), np.ones((2, 4)).tolist()),
        lambda: tl.masked_l1_loss(P.tolist(), T.tolist(), np.ones((2, 4)).tolist()),
        ("ref", _ref_l1),
    ),
    (
        "dice_string_probs",
        lambda: jl.dice_loss("probs", j(T)),
        lambda: tl.dice_loss("probs", t(T)),
        ("raises", TypeError, r"probs must be a.* array-like .*got str"),
    ),
    (
        "db_step_k_not_scalar",
        lambda: jl.db_step(j(P), j(T), k=np.full(4, 50.0)),
        lambda: tl.db_step(t(P), t(T), k=np.full(4, 50.0)),
        ("raises", ValueError, r"k must be a scalar, got shape \(4,\)"),
    ),
    (
        "info_nce_vector_temperature",  # would divide column by column
        lambda: jl.info_nce(j(P), j(P), temperature=j([0.07, 0.5])),
        lambda: tl.info_nce(t(P), t(P), temperature=torch.tensor([0.07, 0.5])),
        ("raises", ValueError, r"temperature must be a scalar, got shape \(2,\)"),
    ),
    (
        "info_nce_matrix_temperature",
        lambda: jl.info_nce(j(P), j(P), temperature=jnp.full((2, 3), 0.07)),
        lambda: tl.info_nce(t(P), t(P), temperature=torch.full((2, 3), 0.07)),
        ("raises", ValueError, r"temperature must be a scalar, got shape \(2, 3\)"),
    ),
    (
        "info_nce_learnable_vector_temperature",  # requires_grad: still refused
        lambda: jax.grad(lambda v: jl.info_nce(j(P), j(P), temperature=v))(
            jnp.full(2, 0.07)
        ),
        lambda: tl.info_nce(
            t(P), t(P), temperature=torch.full((2,), 0.07, requires_grad=True)
        ),
        ("raises", ValueError, r"temperature must be a scalar, got shape \(2,\)"),
    ),
    (
        "info_nce_numpy_inputs",
        lambda: jl.info_nce(P, P),
        lambda: tl.info_nce(P, P),
        ("ref", _ref_info_nce),
    ),
    # torch only: every loss checks that its tensors share one device (one
    # validator); JAX refuses arrays committed to different devices itself.
    (
        "ce_inputs_on_two_devices",
        None,
        lambda: tl.softmax_cross_entropy(xt(), t(Y), weights=_meta(np.ones(5))),
        ("raises", ValueError, DEVICES.format("weights")),
    ),
    (
        "bce_inputs_on_two_devices",
        None,
        lambda: tl.sigmoid_binary_cross_entropy(t(P), _meta(T)),
        ("raises", ValueError, DEVICES.format("targets")),
    ),
    (
        "balanced_bce_inputs_on_two_devices",
        None,
        lambda: tl.balanced_binary_cross_entropy(t(P), t(T), _meta(T)),
        ("raises", ValueError, DEVICES.format("mask")),
    ),
    (
        "dice_inputs_on_two_devices",
        None,
        lambda: tl.dice_loss(_meta(P), t(T)),
        ("raises", ValueError, r"got probs on meta, targets on cpu"),
    ),
    (
        "masked_l1_inputs_on_two_devices",
        None,
        lambda: tl.masked_l1_loss(t(P), _meta(T), t(T)),
        ("raises", ValueError, DEVICES.format("target")),
    ),
    (
        "db_step_inputs_on_two_devices",
        None,
        lambda: tl.db_step(t(P), _meta(T)),
        ("raises", ValueError, DEVICES.format("thresh")),
    ),
    (
        "db_loss_inputs_on_two_devices",
        None,
        lambda: tl.db_loss(t(P), t(P), t(T), t(T), t(T), _meta(T)),
        ("raises", ValueError, DEVICES.format("thresh_mask")),
    ),
    (
        "info_nce_inputs_on_two_devices",  # torch would compute cpu @ meta
        None,
        lambda: tl.info_nce(t(P), _meta(P)),
        ("raises", ValueError, DEVICES.format("b")),
    ),
    (
        "info_nce_temperature_on_another_device",
        None,
        lambda: tl.info_nce(t(P), t(P), temperature=_meta(0.07)),
        ("raises", ValueError, DEVICES.format("temperature")),
    ),
]
# ---------------------------------------------------------------------------
# issue 10: detection losses (box_iou_loss, sigmoid_focal_loss)
# ---------------------------------------------------------------------------

BOX_A = np.array([[0.0, 0.0, 2.0, 2.0], [1.0, 1.0, 4.0, 3.0]], np.float32)
BOX_B = np.array([[1.0, 1.0, 3.0, 3.0], [0.0, 1.0, 2.0, 5.0]], np.float32)
BOX_INVERTED = BOX_A.copy()
BOX_INVERTED[1] = [4.0, 1.0, 1.0, 3.0]  # x1 > x2
BOX_INVERTED_Y = BOX_B.copy()
BOX_INVERTED_Y[0] = [1.0, 3.0, 3.0, 1.0]  # y1 > y2
BOX_NAN = BOX_A.copy()
BOX_NAN[0, 3] = np.nan
# IoU of the pairs: intersections 1 and 1 x 2, unions 4 + 4 - 1 and 6 + 8 - 2
IOU_LOSS_SUM = (1.0 - 1.0 / 7.0) + (1.0 - 2.0 / 12.0)
FOCAL_X = np.array([0.0, 2.0], np.float32)
FOCAL_T = np.array([1.0, 0.0], np.float32)


def _ref_focal_unweighted():
    """gamma = 2, no alpha: x = 0, t = 1 gives 0.5**2 log 2; x = 2, t = 0
    gives sigmoid(2)**2 softplus(2) (torchvision's formula, float64)."""
    p = 1.0 / (1.0 + np.exp(-2.0))
    return (0.25 * np.log(2.0) + p**2 * np.log1p(np.exp(2.0))) / 2


CASES += [
    (
        "box_wrong_last_dim",
        lambda: jl.box_iou_loss(j(BOX_A[:, :3]), j(BOX_B[:, :3])),
        lambda: tl.box_iou_loss(t(BOX_A[:, :3]), t(BOX_B[:, :3])),
        ("raises", ValueError, r"boxes1 must have shape \(\.\.\., 4\).*\(2, 3\)"),
    ),
    (
        "box_scalar",
        lambda: jl.box_iou_loss(j(1.0), j(1.0)),
        lambda: tl.box_iou_loss(t(np.float32(1.0)), t(np.float32(1.0))),
        ("raises", ValueError, r"boxes1 must have shape \(\.\.\., 4\).*got shape \(\)"),
    ),
    (
        "box_integer_boxes",
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_B.astype(np.int32))),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_B.astype(np.int32))),
        ("raises", TypeError, r"boxes2 must be a floating .*int32"),
    ),
    (
        "box_shapes_differ",
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_B[:1])),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_B[:1])),
        ("raises", ValueError, r"boxes1\.shape=\(2, 4\) and boxes2\.shape=\(1, 4\)"),
    ),
    (
        "box_unknown_kind",
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_B), kind="eiou"),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_B), kind="eiou"),
        (
            "raises",
            ValueError,
            r"unknown kind 'eiou'; valid values: iou, giou, diou, ciou",
        ),
    ),
    (
        "box_unknown_reduction",
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_B), reduction="avg"),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_B), reduction="avg"),
        (
            "raises",
            ValueError,
            r"unknown reduction 'avg'; valid values: mean, sum, none",
        ),
    ),
    (
        "box_x2_below_x1",  # torchvision: a silent number from negative areas
        lambda: jl.box_iou_loss(j(BOX_INVERTED), j(BOX_B)),
        lambda: tl.box_iou_loss(t(BOX_INVERTED), t(BOX_B)),
        (
            "raises",
            ValueError,
            r"boxes1 must have x1 <= x2 and y1 <= y2.*1 box\(es\).*index \(1,\): "
            r"\[4\.0, 1\.0, 1\.0, 3\.0\]",
        ),
    ),
    (
        "box_y2_below_y1_in_targets",
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_INVERTED_Y), kind="ciou"),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_INVERTED_Y), kind="ciou"),
        ("raises", ValueError, r"boxes2 must have x1 <= x2.*index \(0,\)"),
    ),
    (
        "box_nan_coordinate",
        lambda: jl.box_iou_loss(j(BOX_NAN), j(BOX_B), kind="iou", reduction="mean"),
        lambda: tl.box_iou_loss(t(BOX_NAN), t(BOX_B), kind="iou", reduction="mean"),
        ("nan",),
    ),
    (
        "box_empty_mean",  # as torchvision: 0.0
        lambda: jl.box_iou_loss(j(BOX_A[:0]), j(BOX_B[:0]), reduction="mean"),
        lambda: tl.box_iou_loss(t(BOX_A[:0]), t(BOX_B[:0]), reduction="mean"),
        ("equals", 0.0),
    ),
    (
        "box_eps_zero",  # a zero-area union would be 0 / 0
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_B), eps=0.0),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_B), eps=0.0),
        ("raises", ValueError, r"eps must be > 0, got 0.0"),
    ),
    (
        "box_list_inputs",
        lambda: jl.box_iou_loss(
            BOX_A.tolist(), BOX_B.tolist(), kind="iou", reduction="sum"
        ),
        lambda: tl.box_iou_loss(
            BOX_A.tolist(), BOX_B.tolist(), kind="iou", reduction="sum"
        ),
        ("ref", lambda: IOU_LOSS_SUM),
    ),
    (
        "focal_targets_wrong_shape",
        lambda: jl.sigmoid_focal_loss(j(P), j(T[:, :3])),
        lambda: tl.sigmoid_focal_loss(t(P), t(T[:, :3])),
        ("raises", ValueError, r"logits\.shape=\(2, 4\) and targets\.shape=\(2, 3\)"),
    ),
    (
        "focal_integer_logits",
        lambda: jl.sigmoid_focal_loss(j(T.astype(np.int32)), j(T)),
        lambda: tl.sigmoid_focal_loss(t(T.astype(np.int32)), t(T)),
        ("raises", TypeError, r"logits must be a floating"),
    ),
    (
        "focal_alpha_above_1",
        lambda: jl.sigmoid_focal_loss(j(P), j(T), alpha=1.5),
        lambda: tl.sigmoid_focal_loss(t(P), t(T), alpha=1.5),
        (
            "raises",
            ValueError,
            r"alpha must be a number in \[0, 1\], or None / -1 .*1.5",
        ),
    ),
    (
        "focal_alpha_negative_not_minus_1",  # torchvision: silently unweighted
        lambda: jl.sigmoid_focal_loss(j(P), j(T), alpha=-0.25),
        lambda: tl.sigmoid_focal_loss(t(P), t(T), alpha=-0.25),
        ("raises", ValueError, r"alpha must be a number in \[0, 1\].*-0.25"),
    ),
    (
        "focal_alpha_minus_1_is_unweighted",  # torchvision's spelling
        lambda: jl.sigmoid_focal_loss(
            j(FOCAL_X), j(FOCAL_T), alpha=-1, reduction="mean"
        ),
        lambda: tl.sigmoid_focal_loss(
            t(FOCAL_X), t(FOCAL_T), alpha=-1, reduction="mean"
        ),
        ("ref", _ref_focal_unweighted),
    ),
    (
        "focal_gamma_negative",
        lambda: jl.sigmoid_focal_loss(j(P), j(T), gamma=-1.0),
        lambda: tl.sigmoid_focal_loss(t(P), t(T), gamma=-1.0),
        ("raises", ValueError, r"gamma must be >= 0, got -1.0"),
    ),
    (
        "focal_gamma_inf",
        lambda: jl.sigmoid_focal_loss(j(P), j(T), gamma=float("inf")),
        lambda: tl.sigmoid_focal_loss(t(P), t(T), gamma=float("inf")),
        ("raises", ValueError, r"gamma must be a finite number >= 0, got inf"),
    ),
    (
        "focal_targets_outside_0_1",
        lambda: jl.sigmoid_focal_loss(j(P), j(T * 2.0)),
        lambda: tl.sigmoid_focal_loss(t(P), t(T * 2.0)),
        ("raises", ValueError, r"targets must be in \[0, 1\]; found \d+ value\(s\)"),
    ),
    (
        "focal_nan_logits",
        lambda: jl.sigmoid_focal_loss(j(P_NAN), j(T), reduction="sum"),
        lambda: tl.sigmoid_focal_loss(t(P_NAN), t(T), reduction="sum"),
        ("nan",),
    ),
    (
        "focal_unknown_reduction",
        lambda: jl.sigmoid_focal_loss(j(P), j(T), reduction="batchmean"),
        lambda: tl.sigmoid_focal_loss(t(P), t(T), reduction="batchmean"),
        ("raises", ValueError, r"unknown reduction 'batchmean'"),
    ),
    (
        "box_inputs_on_two_devices",
        None,
        lambda: tl.box_iou_loss(t(BOX_A), _meta(BOX_B)),
        ("raises", ValueError, DEVICES.format("boxes2")),
    ),
    (
        "focal_inputs_on_two_devices",
        None,
        lambda: tl.sigmoid_focal_loss(t(P), _meta(T)),
        ("raises", ValueError, DEVICES.format("targets")),
    ),
]
# ---------------------------------------------------------------------------
# issue 22 (item 12): every scalar option is a finite number (an eps at least
# float32's smallest normal); issue 21 (item 4): a bad box in a computation
# being differentiated is NaN for that pair in both twins (JAX: traced boxes;
# torch: a box tensor that requires grad), not an exception mid-training.
# ---------------------------------------------------------------------------


def _option_case(name, jax_call, torch_call, pattern):
    return (name, jax_call, torch_call, ("raises", ValueError, pattern))


INF, NAN, SUBNORMAL = float("inf"), float("nan"), 1e-45
FINITE = r"{} must be a finite number {} 0, got {}"
TINY_EPS = r"eps must be >= 1\.1754944e-38 \(float32's smallest normal.*got 1e-45"
DB = (P, P, T, T, T, T)  # db_loss(shrink_logits, thresh, gt, mask, map, mask)

CASES += [
    _option_case(
        "info_nce_temperature_inf",
        lambda: jl.info_nce(j(P), j(P), temperature=INF),
        lambda: tl.info_nce(t(P), t(P), temperature=INF),
        FINITE.format("temperature", ">", "inf"),
    ),
    _option_case(
        "info_nce_temperature_nan",
        lambda: jl.info_nce(j(P), j(P), temperature=j(NAN)),
        lambda: tl.info_nce(t(P), t(P), temperature=torch.tensor(NAN)),
        FINITE.format("temperature", ">", "nan"),
    ),
    _option_case(
        "info_nce_min_temperature_inf",
        lambda: jl.info_nce(j(P), j(P), min_temperature=INF),
        lambda: tl.info_nce(t(P), t(P), min_temperature=INF),
        FINITE.format("min_temperature", ">=", "inf"),
    ),
    _option_case(
        "info_nce_eps_inf",
        lambda: jl.info_nce(j(P), j(P), eps=INF),
        lambda: tl.info_nce(t(P), t(P), eps=INF),
        FINITE.format("eps", ">", "inf"),
    ),
    _option_case(
        "info_nce_eps_nan",
        lambda: jl.info_nce(j(P), j(P), eps=NAN),
        lambda: tl.info_nce(t(P), t(P), eps=NAN),
        FINITE.format("eps", ">", "nan"),
    ),
    _option_case(  # XLA:CPU flushes it: a zero row would be 0 / 0
        "info_nce_eps_subnormal",
        lambda: jl.info_nce(j(P), j(P), eps=SUBNORMAL),
        lambda: tl.info_nce(t(P), t(P), eps=SUBNORMAL),
        TINY_EPS,
    ),
    _option_case(
        "dice_eps_inf",
        lambda: jl.dice_loss(j(P), j(T), eps=INF),
        lambda: tl.dice_loss(t(P), t(T), eps=INF),
        FINITE.format("eps", ">", "inf"),
    ),
    _option_case(  # an empty mask: 0 / (0 + eps) = NaN once eps is flushed
        "dice_eps_subnormal",
        lambda: jl.dice_loss(j(P), j(T), eps=SUBNORMAL),
        lambda: tl.dice_loss(t(P), t(T), eps=SUBNORMAL),
        TINY_EPS,
    ),
    _option_case(
        "balanced_bce_eps_inf",
        lambda: jl.balanced_binary_cross_entropy(j(P), j(T), j(T), eps=INF),
        lambda: tl.balanced_binary_cross_entropy(t(P), t(T), t(T), eps=INF),
        FINITE.format("eps", ">", "inf"),
    ),
    _option_case(
        "balanced_bce_eps_subnormal",
        lambda: jl.balanced_binary_cross_entropy(j(P), j(T), j(T), eps=SUBNORMAL),
        lambda: tl.balanced_binary_cross_entropy(t(P), t(T), t(T), eps=SUBNORMAL),
        TINY_EPS,
    ),
    _option_case(
        "box_eps_nan",
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_B), eps=NAN),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_B), eps=NAN),
        FINITE.format("eps", ">", "nan"),
    ),
    _option_case(
        "box_eps_subnormal",
        lambda: jl.box_iou_loss(j(BOX_A), j(BOX_B), eps=SUBNORMAL),
        lambda: tl.box_iou_loss(t(BOX_A), t(BOX_B), eps=SUBNORMAL),
        TINY_EPS,
    ),
    _option_case(  # a step function with NaN at prob == thresh (inf * 0)
        "db_step_k_inf",
        lambda: jl.db_step(j(P), j(T), k=INF),
        lambda: tl.db_step(t(P), t(T), k=INF),
        FINITE.format("k", ">", "inf"),
    ),
    _option_case(
        "db_step_k_nan",
        lambda: jl.db_step(j(P), j(T), k=NAN),
        lambda: tl.db_step(t(P), t(T), k=NAN),
        FINITE.format("k", ">", "nan"),
    ),
    _option_case(
        "db_loss_k_inf",
        lambda: jl.db_loss(*map(j, DB), k=INF),
        lambda: tl.db_loss(*map(t, DB), k=INF),
        FINITE.format("k", ">", "inf"),
    ),
    _option_case(
        "db_loss_bce_weight_nan",
        lambda: jl.db_loss(*map(j, DB), bce_weight=NAN),
        lambda: tl.db_loss(*map(t, DB), bce_weight=NAN),
        FINITE.format("bce_weight", ">=", "nan"),
    ),
    _option_case(
        "db_loss_l1_weight_inf",
        lambda: jl.db_loss(*map(j, DB), l1_weight=INF),
        lambda: tl.db_loss(*map(t, DB), l1_weight=INF),
        FINITE.format("l1_weight", ">=", "inf"),
    ),
    _option_case(
        "db_loss_dice_weight_negative",
        lambda: jl.db_loss(*map(j, DB), dice_weight=-1.0),
        lambda: tl.db_loss(*map(t, DB), dice_weight=-1.0),
        r"dice_weight must be >= 0, got -1.0",
    ),
    _option_case(
        "db_loss_eps_subnormal",
        lambda: jl.db_loss(*map(j, DB), eps=SUBNORMAL),
        lambda: tl.db_loss(*map(t, DB), eps=SUBNORMAL),
        TINY_EPS,
    ),
    _option_case(
        "focal_gamma_nan",
        lambda: jl.sigmoid_focal_loss(j(P), j(T), gamma=NAN),
        lambda: tl.sigmoid_focal_loss(t(P), t(T), gamma=NAN),
        FINITE.format("gamma", ">=", "nan"),
    ),
    _option_case(
        "focal_alpha_nan",
        lambda: jl.sigmoid_focal_loss(j(P), j(T), alpha=NAN),
        lambda: tl.sigmoid_focal_loss(t(P), t(T), alpha=NAN),
        r"alpha must be a number in \[0, 1\], or None / -1 .*got nan",
    ),
    _option_case(
        "ce_label_smoothing_nan",
        lambda: jl.softmax_cross_entropy(j(X), j(Y), label_smoothing=NAN),
        lambda: tl.softmax_cross_entropy(xt(), t(Y), label_smoothing=NAN),
        r"label_smoothing must be in \[0, 1\], got nan",
    ),
    (
        "box_x2_below_x1_differentiated",  # a training step: NaN, the guard skips
        lambda: jax.value_and_grad(
            lambda b: jl.box_iou_loss(b, j(BOX_B), kind="iou", reduction="mean")
        )(j(BOX_INVERTED))[0],
        lambda: tl.box_iou_loss(
            t(BOX_INVERTED).requires_grad_(), t(BOX_B), kind="iou", reduction="mean"
        ),
        ("nan",),
    ),
    (
        "box_target_y2_below_y1_prediction_differentiated",
        lambda: jax.value_and_grad(
            lambda b: jl.box_iou_loss(b, j(BOX_INVERTED_Y), kind="iou", reduction="sum")
        )(j(BOX_A))[0],
        lambda: tl.box_iou_loss(
            t(BOX_A).requires_grad_(), t(BOX_INVERTED_Y), kind="iou", reduction="sum"
        ),
        ("nan",),
    ),
]
IDS = [c[0] for c in CASES]
MIN_CASES = 25  # per framework (issue 14)


def _check(call, expected, to_float):
    if expected[0] == "raises":
        _, exc, pattern = expected
        with pytest.raises(exc, match=pattern):
            call()
        return
    out = to_float(call())
    if expected[0] == "nan":
        assert np.isnan(out)
    elif expected[0] == "ref":
        np.testing.assert_allclose(out, expected[1](), **tolerance("float32"))
    else:
        assert out == expected[1]


def test_table_has_at_least_25_cases_per_framework():
    assert len(set(IDS)) == len(IDS)
    for side in (1, 2):  # jax, torch
        assert sum(c[side] is not None for c in CASES) >= MIN_CASES


@pytest.mark.parametrize(
    "call,expected",
    [(c[1], c[3]) for c in CASES if c[1]],
    ids=[c[0] for c in CASES if c[1]],
)
def test_bad_input_jax(call, expected):
    _check(call, expected, lambda v: float(np.asarray(v)))


@pytest.mark.parametrize(
    "call,expected",
    [(c[2], c[3]) for c in CASES if c[2]],
    ids=[c[0] for c in CASES if c[2]],
)
def test_bad_input_torch(call, expected):
    _check(call, expected, lambda v: float(v.detach()))


def test_out_of_range_label_under_jit_is_nan_not_finite():
    """JAX only: traced labels cannot raise, so the bad element's loss is NaN."""
    y = j(_bad_labels(Y))
    f = jax.jit(lambda x, y: jl.softmax_cross_entropy(x, y, reduction="none"))
    per = np.asarray(f(j(X), y))
    bad = _bad_labels(Y) != Y
    assert np.all(np.isnan(per[bad])) and np.all(np.isfinite(per[~bad]))
    mean, grad = jax.jit(jax.value_and_grad(jl.softmax_cross_entropy))(j(X), y)
    assert np.isnan(float(mean))
    assert np.all(np.isnan(np.asarray(grad)[bad]))
    assert np.all(np.isfinite(np.asarray(grad)[~bad]))


def test_out_of_range_label_raises_under_eager_grad():
    """Eager jax.grad traces only the logits: the labels are still checked."""
    with pytest.raises(ValueError, match=r"\[-3, 7\]"):
        jax.grad(lambda x: jl.softmax_cross_entropy(x, j(_bad_labels(Y))))(j(X))


# JAX under jit: a bad value in a traced input cannot raise; the loss and its
# gradient are NaN instead, so the guard sees them. (loss(arg, other), arg,
# other): the gradient is taken with respect to `arg`, `other` is traced too.
JIT_CASES = [
    (
        "ce_weights_zero_sum",
        lambda x, w: jl.softmax_cross_entropy(x, j(Y), weights=w),
        j(X),
        j(W_ZERO_SUM),
    ),
    (
        "masked_l1_negative_mask",
        lambda p, m: jl.masked_l1_loss(p, j(T), m),
        j(P),
        j(M_NEGATIVE),
    ),
    (
        "masked_l1_negative_mask_summing_to_zero",  # mean 0 / 0 would be 0.0
        lambda p, m: jl.masked_l1_loss(p, j(T), m),
        j(P),
        j(np.array([[1.0, -1.0, 0, 0], [0, 0, 0, 0]], np.float32)),
    ),
    (
        "balanced_bce_nan_logit_on_negative_pixel",
        lambda x, g: jl.balanced_binary_cross_entropy(
            x, g, j(M_OHEM), negative_ratio=2.0
        ),
        j(L_OHEM),
        j(G_OHEM),
    ),
    (
        "balanced_bce_nan_target_in_mask",
        lambda x, g: jl.balanced_binary_cross_entropy(x, g, j(M_OHEM)),
        j(L_FINITE),
        j(G_NAN),
    ),
    (
        "balanced_bce_nan_mask",
        lambda x, m: jl.balanced_binary_cross_entropy(x, j(G_OHEM), m),
        j(L_FINITE),
        j(M_NAN),
    ),
    (
        "box_x2_below_x1",  # traced boxes cannot raise
        lambda b, g: jl.box_iou_loss(b, g, kind="ciou", reduction="mean"),
        j(BOX_INVERTED),
        j(BOX_B),
    ),
    (
        "focal_targets_outside_0_1",
        lambda x, y: jl.sigmoid_focal_loss(x, y, reduction="mean"),
        j(P),
        j(T * 2.0),
    ),
]


@pytest.mark.parametrize(
    "loss,arg,other", [c[1:] for c in JIT_CASES], ids=[c[0] for c in JIT_CASES]
)
def test_bad_value_under_jit_is_nan_with_nan_gradient(loss, arg, other):
    value, grad = jax.jit(jax.value_and_grad(loss))(arg, other)
    assert np.isnan(float(value))
    assert np.isnan(np.asarray(grad)).any()


def test_vector_temperature_is_refused_under_jit_too():
    """A shape is static: a traced temperature of shape (2,) still raises."""
    f = jax.jit(lambda t: jl.info_nce(j(P), j(P), temperature=t))
    with pytest.raises(ValueError, match=r"temperature must be a scalar"):
        f(jnp.full(2, 0.07))


def test_int64_labels_under_jit_arrive_wrapped_documented():
    """Documented, cannot be changed here: with x64 off, jit converts an int64
    argument to int32 before the loss sees it (2**32 + 1 arrives as 1, a
    valid class). Eager calls check the labels as given and raise."""
    assert not jax.config.jax_enable_x64
    f = jax.jit(jl.softmax_cross_entropy)
    wrapped = np.where(Y_INT64_WRAPS > 2**31, Y_INT64_WRAPS - 2**32, Y_INT64_WRAPS)
    assert float(f(j(X), Y_INT64_WRAPS)) == float(f(j(X), wrapped.astype(np.int32)))
    with pytest.raises(ValueError, match=r"\[4294967297\]"):
        jl.softmax_cross_entropy(j(X), Y_INT64_WRAPS)


def _nan_logit_on_ignored_pixel(side):
    """CE with the ignored element's logits NaN, and balanced BCE with a NaN
    logit outside the mask: (loss values, gradients) of that framework."""
    y = np.where(np.arange(6).reshape(2, 3) == 4, 255, Y)  # Y[1, 1] ignored
    x = X.copy()
    x[1, 1, 2] = np.nan
    mask = np.array([1.0, 1.0, 1.0, 0.0, 1.0], np.float32)  # L_OHEM NaN at 3
    if side == "jax":
        ce = jax.value_and_grad(
            lambda v: jl.softmax_cross_entropy(v, j(y), ignore_index=255)
        )(j(x))
        bce = jax.value_and_grad(
            lambda v: jl.balanced_binary_cross_entropy(v, j(G_OHEM), j(mask))
        )(j(L_OHEM))
        return [(float(v), np.asarray(g)) for v, g in (ce, bce)]
    xt_ = torch.tensor(np.moveaxis(x, -1, 1).copy(), requires_grad=True)
    lt = torch.tensor(L_OHEM, requires_grad=True)
    out = []
    for v, loss in (
        (xt_, tl.softmax_cross_entropy(xt_, t(y), ignore_index=255)),
        (lt, tl.balanced_binary_cross_entropy(lt, t(G_OHEM), t(mask))),
    ):
        loss.backward()
        grad = v.grad.numpy()
        out.append((loss.item(), np.moveaxis(grad, 1, -1) if grad.ndim == 3 else grad))
    return out


@pytest.mark.parametrize("side", ["jax", "torch"])
def test_nan_logit_on_an_ignored_pixel_finite_loss_nan_gradient(side, tol):
    """Documented, the same in both: the ignored element contributes nothing
    to the loss, but its gradient is 0 * NaN = NaN; the guard catches it."""
    (ce, ce_grad), (bce, bce_grad) = _nan_logit_on_ignored_pixel(side)
    ref = _nan_logit_on_ignored_pixel("jax" if side == "torch" else "torch")
    np.testing.assert_allclose([ce, bce], [ref[0][0], ref[1][0]], **tol("float32"))
    assert np.isfinite(ce) and np.isfinite(bce)
    assert (
        np.isnan(ce_grad[1, 1]).all()
        and np.isfinite(np.delete(ce_grad.reshape(6, 5), 4, 0)).all()
    )
    assert np.isnan(bce_grad[3]) and np.isfinite(np.delete(bce_grad, 3)).all()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU flushes")
def test_subnormal_mask_is_empty_in_jax_on_cpu_documented():
    """Documented, cannot be changed: XLA on CPU flushes subnormal float32 to
    zero, so a mask of 1e-40 is an empty mask in JAX (0.0) and a tiny weight
    in torch (the mean |p - t|)."""
    mask = np.full((2, 4), 1e-40, np.float32)
    assert mask[0, 0] > 0  # a subnormal, not a zero, on the host
    assert float(jl.masked_l1_loss(j(P), j(T), j(mask))) == 0.0
    torch_value = tl.masked_l1_loss(t(P), t(T), t(mask)).item()
    np.testing.assert_allclose(torch_value, _ref_l1(), **tolerance("float32"))


# ---------------------------------------------------------------------------
# Edge cases found in review: each gave a silent wrong number or a mismatch.
# ---------------------------------------------------------------------------


def test_ohem_k_agrees_for_a_ratio_not_exact_in_binary():
    """100 positives, ratio 0.57: both pick k = floor(float32(100 * 0.57)) = 57
    (DBNet's float64 reference would pick 56: documented)."""
    n = 400
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(n,)).astype(np.float32)
    targets = np.zeros(n, np.float32)
    targets[:100] = 1.0
    mask = np.ones(n, np.float32)
    j = jl.balanced_binary_cross_entropy(
        jnp.asarray(logits),
        jnp.asarray(targets),
        jnp.asarray(mask),
        negative_ratio=0.57,
    )
    t = tl.balanced_binary_cross_entropy(
        torch.tensor(logits),
        torch.tensor(targets),
        torch.tensor(mask),
        negative_ratio=0.57,
    )
    # the value with k = 57 hardest negatives, in float64
    x = logits.astype(np.float64)
    bce = np.maximum(x, 0) - x * targets + np.log1p(np.exp(-np.abs(x)))
    hardest = np.sort(bce[100:])[::-1][:57]
    expected = (bce[:100].sum() + hardest.sum()) / (100 + 57 + 1e-6)
    np.testing.assert_allclose(float(j), expected, **tolerance("float32"))
    np.testing.assert_allclose(t.item(), expected, **tolerance("float32"))


@pytest.mark.parametrize("side", ["jax", "torch"])
def test_bce_weights_larger_than_logits_are_refused(side):
    logits, targets, weights = np.zeros(3), np.ones(3), np.ones((2, 3))
    with pytest.raises(ValueError, match=r"weights.shape=\(2, 3\) does not broadcast"):
        if side == "jax":
            jl.sigmoid_binary_cross_entropy(
                jnp.asarray(logits), jnp.asarray(targets), weights=jnp.asarray(weights)
            )
        else:
            tl.sigmoid_binary_cross_entropy(
                torch.tensor(logits),
                torch.tensor(targets),
                weights=torch.tensor(weights),
            )


@pytest.mark.parametrize("side", ["jax", "torch"])
def test_balanced_bce_eps_zero_is_refused(side):
    z = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="eps must be > 0"):
        if side == "jax":
            jl.balanced_binary_cross_entropy(
                jnp.asarray(z), jnp.asarray(z), jnp.asarray(z), eps=0.0
            )
        else:
            tl.balanced_binary_cross_entropy(
                torch.tensor(z), torch.tensor(z), torch.tensor(z), eps=0.0
            )
