"""The synthetic segmentation data set: deterministic, well-formed, realistic enough."""

import dataclasses

import numpy as np
import pytest

from examples.common.data import to_nchw, to_nhwc
from examples.segmentation import data, metric

CFG = data.SegmentationConfig(height=64, width=64, num_classes=6)


def test_same_seed_same_batch_and_random_access():
    a = data.batch_at(CFG, "train", 4, index=3, seed=11)
    b = list(data.batches(CFG, "train", 4, seed=11, num_batches=4))[3]
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])


def test_other_seed_other_index_other_split_differ():
    base = data.batch_at(CFG, "train", 4, index=0, seed=0)
    for other in (
        data.batch_at(CFG, "train", 4, index=0, seed=1),
        data.batch_at(CFG, "train", 4, index=1, seed=0),
        data.batch_at(CFG, "heldout", 4, index=0, seed=0),
    ):
        assert not np.array_equal(base["label"], other["label"])
        assert not np.allclose(base["image"], other["image"])


def test_heldout_set_is_deterministic_and_not_a_train_batch():
    a = data.make_dataset(CFG, "heldout", 6, seed=2)
    b = data.make_dataset(CFG, "heldout", 6, seed=2)
    np.testing.assert_array_equal(a["image"], b["image"])
    train = data.make_dataset(CFG, "train", 6, seed=2)
    assert not np.allclose(a["image"], train["image"])


def test_shapes_dtypes_and_value_ranges():
    b = data.batch_at(CFG, "train", 5, index=0)
    assert b["image"].shape == (5, 64, 64, 3) and b["image"].dtype == np.float32
    assert b["label"].shape == (5, 64, 64) and b["label"].dtype == np.int32
    assert np.isfinite(b["image"]).all()
    # colours in [0, 1] normalised as (rgb - 0.5) / 0.25
    assert b["image"].min() >= -2.0 and b["image"].max() <= 2.0
    valid = b["label"][b["label"] != CFG.ignore_index]
    assert valid.min() >= 0 and valid.max() < CFG.num_classes


@pytest.mark.parametrize("target", [0.15, 0.3])
def test_ignored_fraction_is_near_the_target(target):
    cfg = dataclasses.replace(CFG, ignore_fraction=target)
    labels = data.make_dataset(cfg, "train", 16)["label"]
    frac = (labels == cfg.ignore_index).mean(axis=(1, 2))
    # void blobs fill up to the target; only an image whose boundary band
    # alone exceeds it may go over (by that band's excess)
    assert abs(np.median(frac) - target) < 0.01
    assert frac.min() >= target - 0.01


def test_target_below_the_boundary_share_adds_no_void():
    """At 64x64 a 2-px band alone ignores ~10%: a 5% target adds nothing there."""
    low = dataclasses.replace(CFG, ignore_fraction=0.05)
    zero = dataclasses.replace(CFG, ignore_fraction=0.0)
    a = (data.make_dataset(low, "train", 16)["label"] == 255).mean(axis=(1, 2))
    b = (data.make_dataset(zero, "train", 16)["label"] == 255).mean(axis=(1, 2))
    assert (a >= b).all() and (a >= 0.05 - 1e-3).all()
    np.testing.assert_array_equal(a[b >= 0.05], b[b >= 0.05])


def test_boundaries_are_ignored_and_a_wider_band_ignores_more():
    narrow = dataclasses.replace(CFG, boundary_width=1, ignore_fraction=0.0)
    wide = dataclasses.replace(CFG, boundary_width=4, ignore_fraction=0.0)
    n = (data.make_dataset(narrow, "train", 8)["label"] == 255).mean()
    w = (data.make_dataset(wide, "train", 8)["label"] == 255).mean()
    assert 0 < n < w
    none = dataclasses.replace(CFG, boundary_width=0, ignore_fraction=0.0)
    assert (data.make_dataset(none, "train", 8)["label"] == 255).sum() == 0


def test_boundary_band_separates_every_pair_of_classes():
    """No labelled pixel touches a pixel of another labelled class (4-neighbours)."""
    lab = data.make_dataset(CFG, "train", 8)["label"]
    for a, b in ((lab[:, 1:], lab[:, :-1]), (lab[:, :, 1:], lab[:, :, :-1])):
        both_valid = (a != 255) & (b != 255)
        assert not np.any(both_valid & (a != b))


def test_several_classes_present_with_background_dominant():
    labels = data.make_dataset(CFG, "train", 32)["label"]
    counts = np.bincount(labels[labels != 255].ravel(), minlength=CFG.num_classes)
    assert (counts > 0).all(), counts  # every class occurs
    assert counts[0] == counts.max()  # background dominates, as in real sets
    per_image = [len(np.setdiff1d(np.unique(lab), [0, 255])) for lab in labels]
    assert np.mean(per_image) >= 2  # several object classes per image


def test_class_colour_is_informative_but_not_sufficient():
    """Mean colour of a class differs from the others; pixels of a class vary."""
    d = data.make_dataset(CFG, "train", 32)
    img, lab = d["image"], d["label"]
    means = np.stack([img[lab == c].mean(0) for c in range(CFG.num_classes)])
    dists = np.linalg.norm(means[:, None] - means[None], axis=-1)
    assert dists[~np.eye(CFG.num_classes, dtype=bool)].min() > 0.1
    assert min(img[lab == c].std(0).mean() for c in range(CFG.num_classes)) > 0.1


def test_to_nchw_round_trip():
    x = data.batch_at(CFG, "train", 2, 0)["image"]
    y = to_nchw(x)
    assert y.shape == (2, 3, 64, 64) and y.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(to_nhwc(y), x)


def test_mean_iou_ignores_255_and_matches_hand_count():
    label = np.array([[0, 0, 1, 255], [1, 1, 2, 2]])
    pred = np.array([[0, 1, 1, 2], [1, 0, 2, 2]])
    miou, per_class = metric.mean_iou(pred, label, 3)
    # class 0: tp 1, fp 1, fn 1 -> 1/3; class 1: tp 2, fp 1, fn 1 -> 1/2;
    # class 2: tp 2, fp 0, fn 0 -> 1 (the pixel labelled 255 is not counted)
    np.testing.assert_allclose(per_class, [1 / 3, 1 / 2, 1.0])
    assert miou == pytest.approx((1 / 3 + 1 / 2 + 1) / 3)


def test_mean_iou_leaves_absent_classes_out():
    miou, per_class = metric.mean_iou(np.array([0, 0]), np.array([0, 0]), 3)
    assert miou == 1.0 and np.isnan(per_class[1:]).all()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("ignore_fraction", 1.0, "ignore_fraction"),
        ("num_classes", 1, "num_classes"),
        ("boundary_width", -1, "boundary_width"),
        ("min_objects", 9, "min_objects"),
        ("ignore_index", 3, "collides"),
        ("height", 4, "height"),
    ],
)
def test_bad_config_is_rejected_with_a_clear_message(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **{field: value})


def test_bad_split_and_arguments_are_rejected():
    with pytest.raises(ValueError, match="valid splits"):
        data.batch_at(CFG, "test", 2, 0)
    with pytest.raises(ValueError, match="index"):
        data.batch_at(CFG, "train", 2, -1)
    with pytest.raises(ValueError, match="num_images"):
        data.make_dataset(CFG, "train", 0)
    with pytest.raises(ValueError, match="class ids"):
        metric.mean_iou(np.array([7]), np.array([0]), 3)
