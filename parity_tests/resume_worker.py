"""One training run of the kill-and-resume test (parity_tests/test_resume.py).

``python -m parity_tests.resume_worker FRAMEWORK DIR [--hang-in-save]``
trains a tiny MLP for `STEPS` steps in each config (float32 with
``nan_policy="rollback"``, then float16 compute with a moving loss scale)
with ``fit(..., checkpoint_dir=DIR/CONFIG/ck, resume=True,
log_path=DIR/CONFIG/log.jsonl)``: the very same
command, re-run after a kill, finishes the very same runs (one process for
both configs: a JAX process takes ~5 s to start). `--hang-in-save` makes the first
checkpoint of this process hang just before it is committed (before the
rename of orbax's temporary directory, or the `os.replace` of torch's
temporary file), after writing DIR/in_save (the two paths, JSON), so that a
kill lands mid-write.
The test also calls `run_all` in-process for the uninterrupted reference.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

STEPS = 24
EVERY = 4
# fp16: a scale that grows every 3 finite steps from 2**13 and overflows
# float16 (max 65504) on the large batches, so it moves both ways.
SCALE = {"fp32": (2.0**4, 3), "fp16": (2.0**13, 3)}
CONFIGS = tuple(SCALE)
# fp32 rolls back on its NaN batch (step 9) to the snapshot of step 5: a run
# resumed from checkpoint 8 must bring that snapshot (and the policy's
# counts) back from the checkpoint. fp16 skips.
POLICY = {
    "fp32": {"nan_policy": "rollback", "max_consecutive_nonfinite": 1,
             "rollback_every": 5},
    "fp16": {},
}  # fmt: skip


def batches(config: str) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(STEPS):
        x = rng.normal(size=(8, 5)).astype(np.float32)
        if i % 5 == 4:
            x *= 300.0  # overflows float16 gradients at the larger scales
        if i == 9:
            x[0, 0] = np.nan  # a poisoned batch: one skip in both configs
        out.append(x)
    return out


def run_all(framework: str, folder: str, hang_in_save: bool = False) -> dict:
    """Runs (or resumes) each config in ``folder/CONFIG``; returns
    ``{config: final state (JAX) or TrainStep (torch)}``."""
    if hang_in_save:
        _hang_in_first_save(os.path.join(folder, "in_save"))
    fit = _jax_run if framework == "jax" else _torch_run
    out = {}
    for config in CONFIGS:
        os.makedirs(os.path.join(folder, config), exist_ok=True)
        out[config] = fit(config, os.path.join(folder, config), train=True)
    return out


def build(framework: str, config: str):
    """The untrained state (JAX) or TrainStep (torch): a load target."""
    fit = _jax_run if framework == "jax" else _torch_run
    return fit(config, None, train=False)


def _jax_run(config, folder, train):
    import jax
    import jax.numpy as jnp
    import optax

    from jaxstable import loss_scale, transforms
    from jaxstable import train as jtrain

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {
        "w1": jax.random.normal(k1, (5, 16)) * 0.3,
        "w2": jax.random.normal(k2, (16, 1)) * 0.3,
    }

    def loss_fn(p, x):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - jnp.sum(x, -1, keepdims=True)) ** 2)

    policy = (
        "params=float32,compute=float16,output=float32" if config == "fp16" else None
    )
    scale, period = SCALE[config]
    state = jtrain.TrainState.create(
        params=params,
        optimizer=transforms.stable_optimizer(optax.adam(1e-2), max_grad_norm=1.0),
        loss_scale=loss_scale.DynamicLossScale(scale, period=period),
    )
    if not train:
        return state
    step = jtrain.make_train_step(loss_fn, policy=policy)
    state, _ = jtrain.fit(
        state,
        step,
        [jnp.asarray(b) for b in batches(config)],
        progress=False,
        checkpoint_dir=os.path.join(folder, "ck"),
        checkpoint_every=EVERY,
        log_path=os.path.join(folder, "log.jsonl"),
        resume=True,
        **POLICY[config],
    )
    return state


def _torch_run(config, folder, train):
    import torch

    from torchref import loss_scale
    from torchref import train as ttrain

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),  # draws from the RNG: resumed, it must match
        torch.nn.Linear(16, 1),
    )
    scale, period = SCALE[config]

    def loss_fn(m, x):
        return ((m(x) - x.sum(-1, keepdim=True)) ** 2).float().mean()

    step = ttrain.TrainStep(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        loss_fn,
        max_grad_norm=1.0,
        scaler=loss_scale.DynamicLossScale(scale, period=period),
        autocast_dtype=torch.float16 if config == "fp16" else None,
    )
    if not train:
        return step
    ttrain.fit(
        step,
        [torch.from_numpy(b) for b in batches(config)],
        progress=False,
        checkpoint_dir=os.path.join(folder, "ck"),
        checkpoint_every=EVERY,
        log_path=os.path.join(folder, "log.jsonl"),
        resume=True,
        **POLICY[config],
    )
    return step


def _hang_in_first_save(marker: str) -> None:
    """Hangs in the commit of this process's first checkpoint: the rename of
    the complete temporary write onto ``ck/step_NNNNNNNN[.pt]``.

    Patched at `os.rename`/`os.replace`, where every local commit by rename
    ends (orbax through etils' `epath`, torch's checkpoint through
    `os.replace`), not at an orbax internal: a patch of orbax 0.12.8's
    `async_path.rename` did not land in the commit on a newer orbax (GPU
    image, jax 0.11.2). Only a rename ONTO a step name directly under a
    ``ck`` folder hangs, not one of a file inside a step. The marker holds
    both paths, so the test can check what was on disk at the kill.
    """
    commit = re.compile(r"step_\d{8}(\.pt)?")
    replace = os.replace  # the real one: the marker appears whole, at once

    def hook(real):
        def rename(src, dst, *args, **kwargs):
            dst_name, parent = os.path.basename(dst), os.path.dirname(dst)
            if commit.fullmatch(dst_name) and os.path.basename(parent) == "ck":
                with open(f"{marker}.part", "w") as f:
                    json.dump({"src": os.fspath(src), "dst": os.fspath(dst)}, f)
                replace(f"{marker}.part", marker)
                time.sleep(600)  # the test kills the process here
            return real(src, dst, *args, **kwargs)

        return rename

    os.rename, os.replace = hook(os.rename), hook(os.replace)


if __name__ == "__main__":
    run_all(sys.argv[1], sys.argv[2], "--hang-in-save" in sys.argv[3:])
