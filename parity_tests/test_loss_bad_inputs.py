"""The table of bad inputs: each one gets a clear error or its documented result,
in both frameworks (same case names, same messages where the rule is shared)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import tolerance
from jaxstable import losses as jl
from torchref import losses as tl

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
IDS = [c[0] for c in CASES]


def _check(call, expected, to_float):
    if expected[0] == "raises":
        _, exc, pattern = expected
        with pytest.raises(exc, match=pattern):
            call()
        return
    out = to_float(call())
    if expected[0] == "nan":
        assert np.isnan(out)
    else:
        assert out == expected[1]


def test_table_has_at_least_12_cases_per_framework():
    assert len(CASES) >= 12 and len(set(IDS)) == len(IDS)


@pytest.mark.parametrize("call,expected", [(c[1], c[3]) for c in CASES], ids=IDS)
def test_bad_input_jax(call, expected):
    _check(call, expected, lambda v: float(np.asarray(v)))


@pytest.mark.parametrize("call,expected", [(c[2], c[3]) for c in CASES], ids=IDS)
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
