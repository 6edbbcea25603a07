"""Both `fit`s write the same records: history and JSONL, aux scalars included,
and the same rollback records (`nan_policy="rollback"`)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import optax
import torch

from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms
from torchref import loss_scale as tls
from torchref import train as ttrain


def _batches():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(3)]


def test_fit_history_and_log_have_the_same_keys(tmp_path):
    def jax_loss(params, x):
        err = x @ params["w"]
        return jnp.mean(err**2), {"max_err": jnp.max(jnp.abs(err)), "vec": err}

    state = jtrain.TrainState.create(
        params={"w": jnp.ones((3,))}, optimizer=optax.sgd(0.01)
    )
    step = jtrain.make_train_step(jax_loss, has_aux=True)
    _, jhist = jtrain.fit(
        state,
        step,
        [jnp.asarray(b) for b in _batches()],
        log_path=tmp_path / "jax.jsonl",
        progress=False,
    )

    model = torch.nn.Linear(3, 1, bias=False)

    def torch_loss(m, x):
        err = m(x)[:, 0]
        return err.pow(2).mean(), {"max_err": err.abs().max(), "vec": err}

    tstep = ttrain.TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.01), torch_loss
    )
    thist = ttrain.fit(
        tstep,
        [torch.from_numpy(b) for b in _batches()],
        log_path=tmp_path / "torch.jsonl",
        progress=False,
    )
    keys = {"step", "loss", "grad_norm", "loss_scale", "finite", "skipped_total"}
    keys |= {"grads_finite"}  # and "skip_reason" on a skipped step (none here)
    keys |= {"aux['max_err']"}  # scalar aux leaves only; the vector is left out
    assert [set(r) for r in jhist] == [keys] * 3
    assert [set(r) for r in thist] == [keys] * 3
    for name in ("jax", "torch"):
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert [set(json.loads(line)) for line in lines] == [keys] * 3


def _rollback_batches(nan_at, n):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        x = rng.normal(size=(4, 3)).astype(np.float32)
        if i in nan_at:
            x[1, 2] = np.nan
        out.append(x)
    return out


def _fit_both(batches, **kwargs):
    """Runs both fits on y = x @ w (w = ones, SGD, dynamic loss scale).

    Returns the two histories, or for a fit that raised `NonFiniteError`
    ``(step, history)`` of the error.
    """
    state = jtrain.TrainState.create(
        params={"w": jnp.ones((3,))},
        optimizer=transforms.stable_optimizer(optax.sgd(0.01)),
        loss_scale=jls.DynamicLossScale(),
    )
    step = jtrain.make_train_step(lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2))
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    tstep = ttrain.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        lambda m, x: ((m(x)[:, 0] - 1.0) ** 2).mean(),
        scaler=tls.DynamicLossScale(),
    )
    try:
        jout = jtrain.fit(
            state, step, [jnp.asarray(b) for b in batches], progress=False, **kwargs
        )[1]
    except jtrain.NonFiniteError as e:
        jout = (e.step, e.history)
    try:
        tout = ttrain.fit(
            tstep, [torch.from_numpy(b) for b in batches], progress=False, **kwargs
        )
    except ttrain.NonFiniteError as e:
        tout = (e.step, e.history)
    return jout, tout


def _assert_same_records(jhist, thist, tol):
    assert [list(r) for r in jhist] == [list(r) for r in thist]  # keys, in order
    for name in ("step", "finite", "skipped_total", "loss_scale"):
        assert [r[name] for r in jhist] == [r[name] for r in thist], name
    assert [r.get("rolled_back") for r in jhist] == [
        r.get("rolled_back") for r in thist
    ]
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[name] for r in jhist], [r[name] for r in thist], **tol("float32")
        )


def test_fit_rollback_records_are_the_same(tol):
    # NaN at 3 and 4, limit 2, snapshot every 2 steps: both roll back to the
    # state after 2 steps at step 4 (loss scale and skip count included) and
    # go on with batch 5.
    jhist, thist = _fit_both(
        _rollback_batches({3, 4}, 7),
        nan_policy="rollback",
        max_consecutive_nonfinite=2,
        rollback_every=2,
    )
    assert [r["step"] for r in jhist if r.get("rolled_back")] == [4]
    assert [r["finite"] for r in jhist] == [True] * 3 + [False] * 2 + [True] * 2
    assert [r["skipped_total"] for r in jhist] == [0, 0, 0, 1, 2, 0, 0]
    _assert_same_records(jhist, thist, tol)


def test_fit_rollbacks_exhausted_at_the_same_step(tol):
    (jstep, jhist), (tstep, thist) = _fit_both(
        _rollback_batches({1, 2, 4, 5}, 7),
        nan_policy="rollback",
        max_consecutive_nonfinite=2,
        rollback_every=1,
        max_rollbacks=1,
    )
    assert jstep == tstep == 5
    assert [r["step"] for r in jhist if r.get("rolled_back")] == [2]
    _assert_same_records(jhist, thist, tol)


def test_fit_extras_write_the_same_records(tol):
    """time_steps, eval_fn/eval_every, on_step and stop_after_nonfinite: the
    same keys in the same order, eval values, and the same stop step."""
    batches = _rollback_batches({2}, 8)  # NaN input at step 2 (a skipped step)
    state = jtrain.TrainState.create(
        params={"w": jnp.ones((3,))},
        optimizer=transforms.stable_optimizer(optax.sgd(0.01)),
        loss_scale=jls.DynamicLossScale(),
    )
    step = jtrain.make_train_step(lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2))
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    tstep = ttrain.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        lambda m, x: ((m(x)[:, 0] - 1.0) ** 2).mean(),
        scaler=tls.DynamicLossScale(),
    )
    seen = {"jax": [], "torch": []}
    common = dict(time_steps=True, eval_every=2, stop_after_nonfinite=3)
    _, jhist = jtrain.fit(
        state,
        step,
        [jnp.asarray(b) for b in batches],
        progress=False,
        eval_fn=lambda s: {"w_sum": jnp.sum(s.params["w"])},
        on_step=lambda rec, s: seen["jax"].append(dict(rec)),
        **common,
    )
    thist = ttrain.fit(
        tstep,
        [torch.from_numpy(b) for b in batches],
        progress=False,
        eval_fn=lambda s: {"w_sum": s.model.weight.detach().sum()},
        on_step=lambda rec, s: seen["torch"].append(dict(rec)),
        **common,
    )
    # stopped 3 steps after the first non-finite step (2): 6 records
    assert [r["step"] for r in jhist] == list(range(6))
    assert seen["jax"] == jhist and seen["torch"] == thist
    assert all(r["time_s"] > 0 for r in jhist + thist)
    evals = [[r.get("eval['w_sum']") for r in h] for h in (jhist, thist)]
    assert [e is not None for e in evals[0]] == [False, True] * 3
    np.testing.assert_allclose(
        [x for x in evals[0] if x is not None],
        [x for x in evals[1] if x is not None],
        **tol("float32"),
    )
    timeless = [[{k: v for k, v in r.items() if k != "time_s"} for r in h]
                for h in (jhist, thist)]  # fmt: skip
    _assert_same_records(*timeless, tol)
    assert [list(r) for r in jhist] == [list(r) for r in thist]


def test_fit_check_point_records_are_the_same(tmp_path, tol):
    """A loss that marks check points: both fits write the same checks[...]
    keys, in order, and name the same non-finite points (the first one
    first) on the step whose batch holds a NaN; the JSONL lines too."""
    from jaxstable import diagnostics as jdg
    from torchref import diagnostics as tdg

    batches = _rollback_batches({1}, 3)  # NaN in x[1, 2] at step 1

    def jax_loss(params, x):
        h = x @ params["w"]
        loss = jnp.mean((h - 1.0) ** 2)
        checks = jdg.check_points(weights=params["w"], inputs=x, hidden=h, loss=loss)
        return loss, {"checks": checks, "h_max": jnp.max(jnp.abs(h))}

    def torch_loss(m, x):
        h = m(x)[:, 0]
        loss = ((h - 1.0) ** 2).mean()
        checks = tdg.check_points(weights=m.weight, inputs=x, hidden=h, loss=loss)
        return loss, {"checks": checks, "h_max": h.abs().max()}

    state = jtrain.TrainState.create(
        params={"w": jnp.ones((3,))},
        optimizer=transforms.stable_optimizer(optax.sgd(0.01)),
    )
    step = jtrain.make_train_step(jax_loss, has_aux=True)
    _, jhist = jtrain.fit(
        state, step, [jnp.asarray(b) for b in batches],
        log_path=tmp_path / "jax.jsonl", progress=False, locate_first=0,
    )  # fmt: skip
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    tstep = ttrain.TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.01), torch_loss
    )
    thist = ttrain.fit(
        tstep, [torch.from_numpy(b) for b in batches],
        log_path=tmp_path / "torch.jsonl", progress=False, locate_first=0,
    )  # fmt: skip
    names = ("weights", "inputs", "hidden", "loss")
    checks = [f"checks[{n!r}][{f!r}]" for n in names for f in ("finite", "max_abs")]
    expected = ["aux['h_max']", *checks, "non_finite_checks", "first_non_finite_check"]
    for hist in (jhist, thist):
        assert [list(r)[-len(expected) :] for r in hist] == [expected] * 3
        assert [r["non_finite_checks"] for r in hist] == [
            [],
            ["inputs", "hidden", "loss"],
            [],
        ]
        assert [r["first_non_finite_check"] for r in hist] == [None, "inputs", None]
    _assert_same_records(jhist, thist, tol)
    for key in checks[1::2]:  # max_abs: weights, inputs, hidden, loss
        np.testing.assert_allclose(
            [r[key] for r in jhist], [r[key] for r in thist], **tol("float32")
        )
    for name in ("jax", "torch"):
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert [list(json.loads(x)) for x in lines] == [list(r) for r in jhist]
