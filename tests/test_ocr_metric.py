"""DBNet post-processing and the ICDAR detection metric (examples/ocr/metric.py)."""

import numpy as np
import pytest

from examples.ocr import data, metric


def _rect(x0, y0, x1, y1):
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], float)


def _moved(box, dx, dy):
    return box + np.array([dx, dy], float)


def _batch(polys, flags, n_slots=4):
    polygons = np.zeros((1, n_slots, 4, 2), np.float32)
    polygons[0, : len(polys)] = np.stack(polys)
    used = np.arange(n_slots)[None] < len(polys)
    dont_care = np.zeros((1, n_slots), bool)
    dont_care[0, : len(flags)] = flags
    return {"polygons": polygons, "polygon_mask": used, "dont_care": dont_care}


def test_perfect_detections_score_one():
    gts = [_rect(2, 2, 14, 8), _rect(20, 10, 30, 16)]
    assert metric.match_image(gts, [False, False], gts) == (2, 2, 2)
    assert metric.scores_from_counts(2, 2, 2) == {
        "precision_det": 1.0,
        "recall_det": 1.0,
        "hmean": 1.0,
    }


def test_no_detections_score_zero():
    gts = [_rect(2, 2, 14, 8)]
    counts = metric.match_image(gts, [False], [])
    assert counts == (0, 1, 0)
    assert metric.scores_from_counts(*counts)["hmean"] == 0.0


def test_shifted_box_below_iou_half_does_not_match():
    gt = _rect(0, 0, 10, 4)
    # shifted by 4 px: intersection 6x4 = 24, union 56 -> IoU 0.43
    assert metric.match_image([gt], [False], [_moved(gt, 4, 0)]) == (0, 1, 1)
    # shifted by 3 px: intersection 28, union 52 -> IoU 0.54
    assert metric.match_image([gt], [False], [_moved(gt, 3, 0)]) == (1, 1, 1)


def test_one_detection_matches_one_ground_truth():
    gt = _rect(0, 0, 10, 4)
    assert metric.match_image([gt], [False], [gt, gt + 0.2]) == (1, 1, 2)
    assert metric.match_image([gt, gt + 0.2], [False, False], [gt]) == (1, 2, 1)


def test_dont_care_regions_are_excluded():
    care, ignored = _rect(0, 0, 10, 4), _rect(0, 10, 12, 16)
    # a detection on the don't-care word is dropped, the word is not counted
    assert metric.match_image([care, ignored], [False, True], [care, ignored]) == (
        1,
        1,
        1,
    )
    # a detection half outside it (overlap 0.4 of its area) is kept as a false positive
    half_out = _rect(7, 10, 22, 16)
    assert metric.match_image([care, ignored], [False, True], [half_out]) == (0, 1, 1)
    # an image with only don't-care words and no detection counts nothing
    assert metric.match_image([ignored], [True], []) == (0, 0, 0)


def test_unclip_offsets_by_area_ratio_over_perimeter():
    box = _rect(0, 0, 20, 4)
    out = metric.unclip(box, 1.5)
    d = 80 * 1.5 / 48
    np.testing.assert_allclose(out.min(0), [-d, -d], atol=1 / 16)
    np.testing.assert_allclose(out.max(0), [20 + d, 4 + d], atol=1 / 16)
    assert metric.unclip(np.array([[0, 0], [5, 0], [9, 0], [2, 0]], float)) is None


def test_post_processing_of_ground_truth_maps_recovers_the_boxes():
    cfg = data.OCRConfig()
    held = data.make_dataset(cfg, "heldout", 64)
    assert (~held["dont_care"] & held["polygon_mask"]).sum() > 64
    scores = metric.evaluate(held["gt"], held)
    # 129 of the 130 scored words are recovered. The miss is a one-character
    # word of 3.5 x 4 px: its shrunk region is 2 x 2 pixels and the unclipped
    # box is ~2 px too large on each axis (IoU < 0.5); 0.99 leaves no room
    # for a second miss.
    assert scores["precision_det"] >= 0.99 and scores["recall_det"] >= 0.99


def test_post_processing_drops_low_scores_and_tiny_blobs():
    p = np.zeros((32, 32))
    p[4:8, 4:20] = 0.9  # a word
    p[20:24, 4:20] = 0.45  # above bin_thresh 0.3 but its score is below 0.6
    p[28, 28] = 0.9  # one pixel: shorter than min_size
    boxes, scores = metric.boxes_from_map(p)
    assert len(boxes) == 1 and scores[0] == pytest.approx(0.9)
    assert boxes[0][:, 1].max() < 12


def test_evaluate_nonfinite_maps_give_nan_and_bad_shapes_raise():
    b = _batch([_rect(2, 2, 14, 8)], [False])
    p = np.full((1, 16, 16), np.nan)
    assert all(np.isnan(v) for v in metric.evaluate(p, b).values())
    with pytest.raises(ValueError, match="expected \\(N, H, W\\) maps"):
        metric.evaluate(np.zeros((2, 16, 16)), b)
    with pytest.raises(ValueError, match="dont_care flags"):
        metric.match_image([_rect(0, 0, 4, 4)], [], [])


def test_evaluate_a_rendered_box_map():
    # 14 x 7 px. (A thin 15 x 5 box is not recovered: its shrunk region is 2
    # pixel rows, whose contour is 1 px tall; unclip(1.5) makes it 2.4 px, below
    # min_size + 2 = 3 px, so it is dropped. The data's words are at most 2.75
    # times as long as high and recovered, see the test above.)
    gt = _rect(3, 4, 17, 11)
    # a confident prediction of the box's DBNet shrink map
    maps, _ = data.make_labels([gt], [False], 24, 24)
    p = 0.95 * maps["gt"][None]
    assert metric.evaluate(p, _batch([gt], [False]))["hmean"] == 1.0
    # the same map evaluated against a box moved away does not match
    assert metric.evaluate(p, _batch([_moved(gt, 0, 10)], [False]))["hmean"] == 0.0
