"""VOC mAP@0.5 of examples/detection/metric.py against the VOC definition.

The reference below is written from the VOC definition independently of the
module: all-point interpolated AP is the mean, over the ground-truth boxes,
of the best precision reached at or after the rank where each one is found
(``AP = 1/n_gt * sum over true positives k of max_{j >= k} precision(j)``),
which is the area under the precision envelope as a step function of
recall.
"""

import numpy as np
import pytest

from examples.detection import metric


def _reference_ap(tp, num_gt):
    tp = [int(t) for t in tp]
    precision = [sum(tp[: k + 1]) / (k + 1) for k in range(len(tp))]
    return sum(max(precision[k:]) for k in range(len(tp)) if tp[k]) / num_gt


def _reference_map(dets, gt_boxes, gt_classes, num_classes):
    aps = []
    for cl in range(num_classes):
        pairs = enumerate(zip(gt_boxes, gt_classes, strict=True))
        gts = {i: [b for b, c in zip(bs, cs, strict=True) if c == cl]
               for i, (bs, cs) in pairs}  # fmt: skip
        n = sum(len(g) for g in gts.values())
        if n == 0:
            continue
        found = [(s, i, b) for i, (bs, ss, cs) in enumerate(dets)
                 for b, s, c in zip(bs, ss, cs, strict=True) if c == cl]  # fmt: skip
        found.sort(key=lambda t: -t[0])
        used, tp = set(), []
        for _, i, b in found:
            ious = [_iou(b, g) for g in gts[i]]
            best = int(np.argmax(ious)) if ious else -1
            hit = best >= 0 and ious[best] >= 0.5 and (i, best) not in used
            used.add((i, best)) if hit else None
            tp.append(hit)
        aps.append(_reference_ap(tp, n))
    return float(np.mean(aps))


def _iou(a, b):
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - iw * ih
    return iw * ih / union if union > 0 else 0.0


@pytest.mark.parametrize(
    "tp, num_gt, expected",
    [
        ([1, 0, 1], 2, 0.5 * 1 + 0.5 * 2 / 3),
        ([1, 1, 1], 3, 1.0),
        ([0, 0, 1], 1, 1 / 3),  # the one hit comes third
        ([1, 0, 0, 1], 4, 0.25 * 1 + 0.25 * 0.5),  # recall stops at 0.5
        ([0, 1, 0, 1], 2, 0.5 * 0.5 + 0.5 * 0.5),
        ([], 2, 0.0),
    ],
)
def test_average_precision_on_fixed_cases(tp, num_gt, expected, tol):
    t = tol("float64")
    got = metric.average_precision(np.array(tp), num_gt)
    assert got == pytest.approx(expected, rel=t["rtol"], abs=t["atol"])
    assert got == pytest.approx(_reference_ap(tp, num_gt), rel=t["rtol"], abs=t["atol"])


def test_matching_follows_voc():
    gt = [np.array([[0.0, 0, 10, 10], [20.0, 20, 30, 30]])]
    cls = [np.array([0, 0])]
    # a duplicate of a matched box is a false positive; IoU exactly 0.5 matches
    boxes = np.array([[0.0, 0, 10, 10], [0.0, 0, 10, 10], [20.0, 20, 30, 40]])
    det = [(boxes, np.array([0.9, 0.8, 0.7]), np.array([0, 0, 0]))]
    value, aps = metric.mean_average_precision(det, gt, cls, 2)
    assert aps[1] is None  # no ground truth of class 1
    # ranks: TP, FP, TP -> 0.5 * 1 + 0.5 * 2/3
    assert value == pytest.approx(0.5 + 1 / 3)
    # a detection of the wrong class finds nothing
    det = [(boxes[:1], np.array([0.9]), np.array([1]))]
    assert metric.mean_average_precision(det, gt, cls, 2)[0] == 0.0


def test_against_the_reference_on_random_cases(tol):
    rng = np.random.default_rng(0)
    t = tol("float64")
    for _ in range(20):
        n_img, n_cls = 4, 3
        gt_boxes, gt_classes, dets = [], [], []
        for _ in range(n_img):
            k = rng.integers(0, 4)
            xy = rng.uniform(0, 20, (k, 2))
            gt = np.concatenate([xy, xy + rng.uniform(2, 10, (k, 2))], 1)
            gt_boxes.append(gt)
            gt_classes.append(rng.integers(0, n_cls, k))
            # jittered copies of the truth and random boxes
            m = rng.integers(0, 6)
            src = gt[rng.integers(0, max(k, 1), m)] if k else np.zeros((m, 4)) + 5
            boxes = src + rng.normal(0, 1.5, (m, 4))
            boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2])
            dets.append((boxes, rng.random(m), rng.integers(0, n_cls, m)))
        if sum(len(c) for c in gt_classes) == 0:
            continue
        got, _ = metric.mean_average_precision(dets, gt_boxes, gt_classes, n_cls)
        want = _reference_map(dets, gt_boxes, gt_classes, n_cls)
        assert got == pytest.approx(want, rel=t["rtol"], abs=t["atol"])


def test_evaluate_is_nan_on_non_finite_outputs_and_one_on_perfect_ones():
    heldout = {
        "boxes": np.array([[[2.0, 2, 10, 10]]]),
        "classes": np.array([[2]]),
        "box_mask": np.array([[True]]),
    }
    logits = np.full((1, 2, 2, 3), -9.0)
    logits[0, 1, 1, 2] = 3.0
    raw = np.zeros((1, 2, 2, 4))
    scores = metric.evaluate(logits, raw, heldout)
    assert scores["map50"] == scores["ap50_triangle"] == scores["ap50_any_class"] == 1
    assert np.isnan(scores["ap50_rectangle"]) and np.isnan(scores["ap50_disc"])
    raw[0, 0, 0, 0] = np.nan
    assert all(np.isnan(v) for v in metric.evaluate(logits, raw, heldout).values())


def test_confused_classes_keep_the_class_free_ap():
    # two objects found where they are, each called by the other's class
    heldout = {
        "boxes": np.array([[[2.0, 2, 10, 10], [10.0, 10, 18, 18]]]),
        "classes": np.array([[0, 1]]),
        "box_mask": np.array([[True, True]]),
    }
    logits = np.full((1, 4, 4, 3), -9.0)
    logits[0, 1, 1, 1] = 2.0  # the rectangle's cell says disc
    logits[0, 3, 3, 0] = 2.0  # the disc's cell says rectangle
    raw = np.zeros((1, 4, 4, 4))
    scores = metric.evaluate(logits, raw, heldout)
    assert scores["map50"] == scores["ap50_rectangle"] == scores["ap50_disc"] == 0
    assert scores["ap50_any_class"] == 1


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="num_gt must be >= 1"):
        metric.average_precision(np.array([1]), 0)
    with pytest.raises(ValueError, match="one entry per image"):
        metric.mean_average_precision([], [np.zeros((0, 4))], [np.zeros(0)], 1)


def _reference_detect(cls_logits, box_raw, score_thresh=0.05, nms_iou=0.5, max_det=20):
    # per image and class: greedy NMS (metric.nms, one box at a time) on the
    # candidates above the threshold, then the classes merged by score
    out = []
    for logits, raw in zip(cls_logits, box_raw, strict=True):
        scores = 1 / (1 + np.exp(-logits.reshape(-1, logits.shape[-1])))
        boxes = metric.decode_grid(raw)
        picks = []
        for cl in range(scores.shape[1]):
            cand = np.nonzero(scores[:, cl] > score_thresh)[0]
            for i in cand[metric.nms(boxes[cand], scores[cand, cl], nms_iou)]:
                picks.append((scores[i, cl], i, cl))
        picks.sort(key=lambda t: -t[0])  # stable: class, then NMS order on ties
        picks = picks[:max_det]
        out.append(([boxes[i] for _, i, _ in picks], [s for s, _, _ in picks],
                    [c for _, _, c in picks]))  # fmt: skip
    return out


@pytest.mark.parametrize("ties", [False, True])
def test_detect_equals_per_class_nms(ties):
    rng = np.random.default_rng(1 + ties)
    logits = rng.normal(-1.5, 2.0, (16, 8, 8, 3))
    raw = rng.normal(0.5, 0.4, (16, 8, 8, 4))
    if ties:  # few distinct scores and boxes: equal scores and IoUs everywhere
        logits = np.round(logits)
        raw = np.round(raw * 2) / 2
    got = metric.detect(logits, raw)
    want = _reference_detect(logits, raw)
    assert sum(len(s) for _, s, _ in got) > 100  # enough detections to compare
    for (gb, gs, gc), (wb, ws, wc) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gb, np.array(wb).reshape(-1, 4))
        np.testing.assert_array_equal(gs, ws)
        np.testing.assert_array_equal(gc, wc)
