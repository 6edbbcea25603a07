"""The synthetic OCR data set and its DBNet labels (examples/ocr/data.py)."""

import numpy as np
import pytest
from shapely.geometry import Polygon

from examples.ocr import data


def _rect(x0, y0, x1, y1):
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], float)


def _rotated(cx, cy, length, height, degrees):
    a = np.deg2rad(degrees)
    u = np.array([np.cos(a), np.sin(a)]) * length / 2
    v = np.array([-np.sin(a), np.cos(a)]) * height / 2
    c = np.array([cx, cy])
    return np.stack([c - u - v, c + u - v, c + u + v, c - u + v])


def test_batches_are_deterministic_and_splits_differ():
    cfg = data.OCRConfig()
    a = data.batch_at(cfg, "train", 4, index=3, seed=7)
    b = data.batch_at(cfg, "train", 4, index=3, seed=7)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    other = data.batch_at(cfg, "heldout", 4, index=3, seed=7)
    assert not np.array_equal(a["image"], other["image"])
    listed = list(data.batches(cfg, "train", 4, seed=7, num_batches=4))
    np.testing.assert_array_equal(listed[3]["gt"], a["gt"])


def test_batch_layout_and_ranges():
    b = data.batch_at(data.OCRConfig(height=48, width=40), "train", 6, 0)
    assert b["image"].shape == (6, 48, 40, 3) and b["image"].dtype == np.float32
    for key in data.MAP_KEYS:
        assert b[key].shape == (6, 48, 40) and b[key].dtype == np.float32
    assert set(np.unique(b["gt"])) <= {0.0, 1.0}
    assert set(np.unique(b["mask"])) <= {0.0, 1.0}
    gray = b["image"] * 0.25 + 0.5
    assert gray.min() >= 0.0 and gray.max() <= 1.0
    assert b["polygon_mask"].sum() >= 6  # min_words=1 per image
    assert np.all(b["gt"][b["mask"] == 0] == 0)  # no text target on ignored pixels


@pytest.mark.parametrize("degrees", [0.0, 17.0, -30.0])
def test_shrunk_area_matches_the_offset_formula(degrees):
    # A rectangle L x H offset inwards by D with round joins is the
    # rectangle (L - 2D) x (H - 2D) (inward offsets keep sharp corners).
    poly = _rotated(30.0, 20.0, 36.0, 12.0, degrees)
    shape = Polygon(poly)
    d = shape.area * (1 - 0.4**2) / shape.length
    assert data.shrink_distance(poly, 0.4) == pytest.approx(d)
    (shrunk,) = data.offset_polygon(poly, -d)
    expected = (36.0 - 2 * d) * (12.0 - 2 * d)
    # pyclipper rounds the vertices to 1/16 px: area error <= perimeter / 16
    assert Polygon(shrunk).area == pytest.approx(
        expected, abs=Polygon(shrunk).length / 16
    )
    maps, ignored = data.make_labels([poly], [False], 48, 64)
    assert ignored == [False]
    # the rasterised shrink map covers the shrunk area to within its border
    assert abs(maps["gt"].sum() - expected) <= Polygon(shrunk).length / 2


def test_threshold_map_range_and_mask():
    polys = [_rotated(20, 16, 24, 8, 10), _rect(6, 34, 40, 44)]
    maps, ignored = data.make_labels(polys, [False, False], 52, 52)
    assert ignored == [False, False]
    t, m = maps["thresh_map"], maps["thresh_mask"]
    assert t.min() >= 0.3 - 1e-6 and t.max() <= 0.7 + 1e-6
    assert np.all(t[m == 0] == pytest.approx(0.3))
    inside = t[m == 1]
    assert inside.size > 0 and inside.max() > 0.68  # on the borders: near 0.7
    # the polygon border is at distance 0 -> 0.7; the dilated border -> 0.3
    assert t[34, 20] == pytest.approx(0.7, abs=0.02)
    # the shrunk text region lies inside the threshold mask
    assert np.all(m[maps["gt"] == 1] == 1)


def test_degenerate_and_tiny_polygons_are_ignored_without_crashing():
    line = np.array([[2, 2], [20, 2], [30, 2], [10, 2]], float)  # zero area
    point = np.array([[5, 5], [5, 5], [5, 5], [5, 5]], float)
    bowtie = np.array([[0, 0], [10, 10], [10, 0], [0, 10]], float)  # self-crossing
    tiny = _rect(30, 30, 36, 31.5)  # 1.5 px high < min_text_size 3
    two_points = np.array([[1, 1], [4, 4]], float)
    good = _rect(4, 20, 24, 28)
    polys = [line, point, bowtie, tiny, two_points, good]
    maps, ignored = data.make_labels(polys, [False] * 6, 40, 40)
    assert ignored == [True, True, True, True, True, False]
    assert maps["mask"][30:32, 30:37].max() == 0.0  # the tiny box is masked out
    assert maps["gt"].sum() > 0 and maps["gt"][25:40, 28:40].sum() == 0


def test_dont_care_flag_masks_the_region():
    box = _rect(4, 4, 28, 14)
    maps, ignored = data.make_labels([box], [True], 32, 32)
    assert ignored == [True]
    assert maps["gt"].sum() == 0 and maps["thresh_mask"].sum() == 0
    assert maps["mask"][9, 16] == 0.0 and maps["mask"][25, 16] == 1.0


def test_generated_dont_care_words_are_masked():
    cfg = data.OCRConfig(dont_care_prob=0.5, min_words=3)
    b = data.make_dataset(cfg, "heldout", 16)
    assert b["dont_care"].any() and (~b["dont_care"] & b["polygon_mask"]).any()
    for i in range(16):
        polys, flags = data.polygons_of(b, i)
        for poly, flag in zip(polys, flags, strict=True):
            cx, cy = np.round(poly.mean(0)).astype(int)
            assert b["mask"][i, cy, cx] == (0.0 if flag else 1.0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown split 'test'"):
        data.batch_at(data.OCRConfig(), "test", 2, 0)
    with pytest.raises(ValueError, match="thresh_min"):
        data.OCRConfig(thresh_min=0.8)
    with pytest.raises(ValueError, match="dont_care flags"):
        data.make_labels([_rect(0, 0, 5, 5)], [], 8, 8)
