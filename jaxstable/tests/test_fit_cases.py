"""`jaxstable.train.fit`'s cases of issue 34 that only JAX has: asynchronous
orbax saves of a rewinding run, and `locate` of an optimizer that takes
``value=``."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import optax

from jaxstable import train, transforms

_STEP = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))


def _linear():
    tx = transforms.stable_optimizer(optax.sgd(0.1))
    state = train.TrainState.create(params=jnp.zeros(2), optimizer=tx)
    return state, _STEP


def test_async_checkpoints_of_a_rewinding_run_pass_their_checksums(tmp_path):
    # Every other batch NaN, a checkpoint every 2 steps written in the
    # background: the NaN policy's window of skipped steps grows after each
    # save is issued. The old loop handed orbax the live list, so a
    # checkpoint's meta was written after the next step appended to it and
    # failed its own sha256.
    state, step = _linear()
    data = [jnp.array([jnp.nan, 1.0]) if i % 2 == 0 else jnp.ones(2) for i in range(12)]
    mgr = train.CheckpointManager(tmp_path, max_to_keep=6)
    train.fit(
        state,
        step,
        data,
        nan_policy=train.NanPolicy.rewind(after=50, window=50, locate_first=0),
        checkpoint=train.Checkpointing(mgr, every=2),
        log=None,
    )
    mgr.wait()
    assert mgr.steps() == list(range(2, 13, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a damaged checkpoint is a warning
        for n in mgr.steps():
            _, info = mgr.restore(state, n)
            skipped = [i for i in range(n) if i % 2 == 0]
            assert info["fit_state"]["recent"] == skipped, n
    mgr.close()


class _Recording(train.CheckpointManager):
    """A manager that keeps what fit handed to each save, and its JSON then."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed = []

    def save_for_fit(self, step, state, data_position=None, metrics=None,
                     fit_state=None, snapshot=None):  # fmt: skip
        self.handed.append((fit_state, json.dumps(fit_state)))
        super().save_for_fit(step, state, data_position, metrics, fit_state, snapshot)


def test_fit_hands_no_live_object_to_a_save(tmp_path):
    # The deterministic half of the case above: what fit hands a save must
    # not change after the save is issued (orbax writes it later).
    state, step = _linear()
    data = [jnp.array([jnp.nan, 1.0]) if i % 2 == 0 else jnp.ones(2) for i in range(8)]
    mgr = _Recording(tmp_path)
    train.fit(
        state,
        step,
        data,
        nan_policy=train.NanPolicy.rewind(after=50, window=50, locate_first=0),
        checkpoint=train.Checkpointing(mgr, every=2),
        log=None,
    )
    mgr.close()
    assert len(mgr.handed) == 4
    for handed, then in mgr.handed:
        assert json.dumps(handed) == then


def test_fit_locates_an_update_of_an_optimizer_that_takes_value(tmp_path):
    # reduce_on_plateau takes value= (the loss); Adam with eps=0 divides 0 by
    # 0 on a zero gradient, so the step is non-finite in its update phase.
    # The old locate re-ran the update without value= and raised TypeError,
    # killing a nan_policy="skip" run.
    plateau = optax.contrib.reduce_on_plateau(patience=2, accumulation_size=1)
    tx = transforms.stable_optimizer(optax.chain(optax.adam(0.1, eps=0.0), plateau))
    state = train.TrainState.create(params=jnp.ones(2), optimizer=tx)
    step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
    _, hist = train.fit(state, step, [jnp.ones(2), jnp.zeros(2)], log=None)
    assert [r["finite"] for r in hist] == [False, True]
    assert hist[0]["skip_reason"] == "non-finite update"
    assert hist[0]["location"]["phase"] == "update"
