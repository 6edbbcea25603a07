"""The synthetic detection data (examples/detection/data.py)."""

import numpy as np
import pytest

from examples.detection import data


def test_batches_are_deterministic_and_targets_consistent():
    cfg = data.DetectionConfig()
    a = data.batch_at(cfg, "train", 4, index=3, seed=1)
    b = data.batch_at(cfg, "train", 4, index=3, seed=1)
    for key in ("image", *data.BOX_KEYS):
        np.testing.assert_array_equal(a[key], b[key])
    g = cfg.grid
    used = a["box_mask"]
    assert used.any(1).all()  # every image has an object
    boxes = a["boxes"]
    assert (boxes[..., 2:] >= boxes[..., :2]).all()  # x2 >= x1, y2 >= y1
    assert ((boxes >= 0) & (boxes <= cfg.size)).all()
    np.testing.assert_array_equal(
        boxes[~used], np.tile(data.PAD_BOX, (int((~used).sum()), 1))
    )
    # each used object's class is set at its centre cell of the heatmap
    for i, j in np.argwhere(used):
        cell = a["cells"][i, j]
        assert cell == data.center_cells(boxes[i, j], cfg.size)
    assert a["heatmap"].sum() <= used.sum()
    assert a["heatmap"].shape == (4, g, g, data.NUM_CLASSES)


def test_crop_keeps_touching_boxes_with_zero_width():
    boxes = np.array([[0.0, 0, 4, 4], [10.0, 10, 12, 12], [4.0, 4, 6, 6]])
    out, keep = data.crop_boxes(boxes, x0=4, y0=4, side=4, size=8)
    # the first touches the window only at its corner: a point box
    assert keep.tolist() == [True, False, True]
    assert out[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out[2].tolist() == [0.0, 0.0, 4.0, 4.0]


def test_augmentation_produces_degenerate_boxes_heldout_none():
    cfg = data.DetectionConfig()
    # 7 batches: the train stream of seed 0 has its first one in batch 6
    found = [d for b in data.batches(cfg, "train", 8, num_batches=7)
             for d in data.degenerate_boxes(b)]  # fmt: skip
    assert found, "the crop should leave zero-width/height boxes at its border"
    heldout = data.make_dataset(cfg, "heldout", 16)
    assert data.degenerate_boxes(heldout) == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        data.DetectionConfig(size=12)
    with pytest.raises(ValueError, match="min_size <= max_size"):
        data.DetectionConfig(min_size=0.5, max_size=0.2)
    with pytest.raises(ValueError, match="unknown split"):
        data.batch_at(data.DetectionConfig(), "test", 2, 0)
    with pytest.raises(ValueError, match="num_images must be >= 1"):
        data.generate(
            data.DetectionConfig(), 0, np.random.default_rng(0), augment=False
        )
