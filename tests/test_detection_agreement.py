"""The float32 detection runs: JAX and torch agree, until the dynamics amplify.

The committed comparison's `fp32_agreement` (max relative loss difference of
the float32 JAX and torch runs over 50 steps) is 5.9e-3, above the 1e-3 it
aims for. These tests pin down the two facts the README gives as the
reason (examples/detection/divergence.py measures them):

* at the same weights, on the same batch, JAX and torch compute the same
  gradient (to 4e-6 relative, every parameter, each of the 50 steps of
  the torch run);
* without the box-regression term the whole training stack (detector,
  batch norm, focal loss, YOLO recipe, EMA) agrees across the frameworks to
  float32 rounding for 40 steps (50 on the CPU of the committed runs; see
  `AGREE_STEPS`);
* with it, JAX disagrees with itself after a 1e-7 change of its starting
  weights: the dynamics, not a framework difference, make the drift.
"""

import numpy as np
import pytest

from examples.detection import divergence

# about 45 s of CPU at XLA's default optimisations: queued first and
# compiled with fewer of them (conftest.py), 29 s. The gaps move in their
# last bits, the relations hold with room (Intel Xeon, 2026-11-28: see the
# measured values below, "fewer" for this compile).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

STEPS = 50


def test_same_weights_same_gradients_for_50_steps():
    out = divergence.gradient_split(STEPS, threshold=1e-4)
    assert out["split"] is None, out["split"]
    assert out["steps"] == STEPS
    assert out["max_relative_difference"] < 1e-4  # measured 3.8e-6, fewer 3.4e-6


# The steps the box-free runs agree to float32 rounding on every CPU
# measured: 50 on the AMD EPYC the committed runs came from (max 7.3e-7);
# on an Intel Xeon (2026-11-27) 1.0e-6 up to step 39, then 1.7e-5 at step
# 45 and 8.3e-4 at step 49, a jump a 1e-7 nudge of the JAX run does not
# make (it stays below 2.3e-7): a framework difference past step 40 on
# that CPU, not yet explained.
AGREE_STEPS = 40


def test_without_the_box_term_jax_and_torch_agree_for_40_steps():
    out = divergence.float32_losses(AGREE_STEPS, runs=("jax", "torch"), box_weight=0.0)
    gap = divergence.relative_differences(out["jax"], out["torch"])
    assert len(gap) == AGREE_STEPS and np.all(np.isfinite(gap))
    # measured 7.3e-7 (EPYC), 1.0e-6 (Xeon), fewer 3.2e-6 (Xeon, at step 1)
    assert gap.max() < 1e-5, gap.max()


def test_with_the_box_term_a_1e7_nudge_grows_past_1e4_within_50_steps():
    out = divergence.float32_losses(STEPS, runs=("jax", "jax_nudged"), rel=1e-7)
    gap = divergence.relative_differences(out["jax"], out["jax_nudged"])
    assert gap[:20].max() < 1e-5, gap[:20]  # rounding-sized at first
    # measured 3.0e-2 (EPYC, past 1e-5 at step 26), 2.2e-2 (Xeon, step 33);
    # fewer 9.9e-4 (Xeon, past 1e-5 at step 45)
    assert gap.max() > 1e-4, gap.max()
