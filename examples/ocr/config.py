"""Hyper-parameters of the OCR (DBNet) task: values only, as flax configs are.

The harness (`examples/harness.py`) builds a run's config from these values.
They train the small DBNet to a held-out hmean of about 0.75 in float32 in
400 steps on the default data, in both frameworks (measured 2026-11-23 on the
shared 2-core CPU box; numbers and timings in ``examples/ocr/README.md``).

``TRAIN``: the fields the harness's ``BaseConfig`` has (sizes, optimizer,
guards). ``DATA``: `data.OCRConfig` fields. ``POSTPROCESS``: keyword
arguments of `metric.boxes_from_map` (via `metric.evaluate`).

Example:
    >>> TRAIN["width"], TRAIN["learning_rate"], POSTPROCESS["box_thresh"]
    (12, 0.005, 0.5)
    >>> from examples.ocr import data
    >>> data.OCRConfig(height=TRAIN["image_size"], width=TRAIN["image_size"],
    ...                **DATA).max_words
    4
"""

from __future__ import annotations

TRAIN = dict(
    # 32x32: torch's float16 CPU convolution (autocast) took 150 / 280 / 490
    # ms per step at width 8 / 12 / 16 (fp32: 55 / 80 / 120 ms) under load;
    # 400 fp16 steps at width 12 are ~2 minutes of the 5-minute budget.
    image_size=32,
    batch_size=8,
    # width 8 reached hmean 0.59-0.69 (box_thresh 0.3) in 400-600 steps, 12
    # reached 0.74-0.75, 16 reached 0.81 but at 1.7x the fp16 step time.
    width=12,
    steps=400,
    optimizer="adam",
    # 2e-3: loss 2.84 at step 280 and hmean 0.36 at width 8; 5e-3: 0.61;
    # 1e-2: 0.69 (width 8). 5e-3 at width 12 with the stable clip of 1.0.
    learning_rate=5e-3,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    max_grad_norm=1.0,
    # 128 held-out images carry ~290 scored words: one word is 0.35 recall
    # points, so the stable-vs-float32 comparison (5 points) is not noise.
    eval_images=128,
    eval_batch_size=64,
)

DATA = dict(
    min_words=1,
    max_words=4,
    min_text_height=4.0,
    max_text_height=9.0,
    min_chars=1,
    max_chars=4,
    max_angle=30.0,
    dont_care_prob=0.1,
    min_text_size=3.0,
    shrink_ratio=0.4,
    thresh_min=0.3,
    thresh_max=0.7,
)

POSTPROCESS = dict(
    bin_thresh=0.3,
    # DBNet's 0.6 keeps only the most confident boxes of a model trained for
    # 400 steps: recall 0.47 at width 12 / 16 (precision 0.88-0.90) against
    # 0.71-0.79 at 0.5, where precision is still 0.78-0.85.
    box_thresh=0.5,
    unclip_ratio=1.5,
    min_size=1.0,
)

# DBNet's approximate binarisation amplification (k) of db_step.
STEP_K = 50.0
