"""The guard's invariant, in both frameworks: no step ever writes a non-finite
value into the parameters or the optimizer state.

Finite gradients do not make a finite step. Each case below has finite
gradients and an optimizer whose own arithmetic goes non-finite, for a real
reason (nothing is injected): Adam with ``eps=0`` divides 0 by 0; float16
Adam state underflows (``(1 - b2) * g**2`` < 6e-8, the smallest float16
subnormal) and ``eps = 1e-8`` rounds to 0 in float16; a float16 parameter
overflows 65504 when its update is added; a learning rate of NaN (a warmup
schedule dividing by zero warmup steps); decoupled weight decay pushing a
float16 parameter past 65504. In both frameworks such a step is skipped like
a non-finite gradient: parameters and optimizer state unchanged, counted in
``skipped_total`` and ``non_finite_updates``, told apart by
``last_grads_finite`` / ``grads_finite``; the loss scale reacts to the
gradients only (as GradScaler's does).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import loss_scale as tls
from torchref import train as ttrain
from torchref import transforms as ttx

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")


@dataclasses.dataclass(frozen=True)
class Case:
    """One optimizer that turns finite gradients into a non-finite step.

    ``grads[i]`` is fed at step i; ``bad`` lists the steps that must be
    skipped although their gradients are finite. ``lrs`` (optional) sets the
    learning rate before each step (a schedule's value). ``jax_tx`` is the
    optimizer that `stable_optimizer` wraps, unless ``guarded`` says it is
    already the whole guarded transformation.
    """

    name: str
    dtype: str
    params: dict[str, list[float]]
    grads: list[dict[str, list[float]]]
    bad: tuple[int, ...]
    jax_tx: Callable[[], optax.GradientTransformation]
    torch_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    lrs: tuple[float, ...] | None = None
    guarded: bool = False


def _guarded_sgd_injected():
    # The learning rate is a hyperparameter outside the guard, set by the
    # loop each step as a torch LR scheduler sets param_groups[0]["lr"].
    def make(learning_rate):
        return jtx.stable_optimizer(optax.sgd(learning_rate))

    return optax.inject_hyperparams(make)(learning_rate=0.1)


CASES = [
    Case(
        "adam_eps0_zero_gradient",  # m / (sqrt(v) + 0) = 0 / 0 where g = 0
        "float32",
        {"w": [1.0, 1.0, 1.0]},
        [{"w": [1.0, 0.0, 2.0]}, {"w": [1.0, 0.5, 2.0]}, {"w": [0.5, 0.5, 0.5]}],
        (0,),
        lambda: optax.adam(1e-3, eps=0.0),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=0.0),
    ),
    Case(
        # (1 - b2) g**2 = 1e-3 * 1e-6 underflows to 0 in float16 and eps=1e-8
        # is 0 in float16: m / 0 = inf. A gradient of 1 does not underflow.
        "float16_adam_second_moment_underflow",
        "float16",
        {"w": [0.5, 0.5, 0.5, 0.5]},
        [{"w": [1e-3, 1e-3, 1e-3, 1e-3]}, {"w": [1.0, 1.0, 1.0, 1.0]}],
        (0,),
        lambda: optax.adam(1e-3),
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
    ),
    Case(
        "float16_parameter_overflow",  # 60000 + 10000 > 65504
        "float16",
        {"w": [60000.0, 1.0]},
        [{"w": [-10000.0, 1.0]}, {"w": [1.0, 1.0]}],
        (0,),
        lambda: optax.sgd(1.0),
        lambda ps: torch.optim.SGD(ps, lr=1.0),
    ),
    Case(
        "nan_learning_rate",  # warmup lr = base * step / warmup_steps, 0 / 0
        "float32",
        {"w": [1.0, -1.0]},
        [{"w": [1.0, 1.0]}, {"w": [1.0, 1.0]}, {"w": [0.5, 0.5]}],
        (1,),
        _guarded_sgd_injected,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lrs=(0.1, float("nan"), 0.1),
        guarded=True,
    ),
    Case(
        # decoupled decay: p * (1 - lr * wd) = 2 * (1 - 1e5) < -65504
        "float16_weight_decay_overflow",
        "float16",
        {"w": [2.0, 0.001]},
        [{"w": [1.0, 1.0]}],
        (0,),
        lambda: optax.adamw(1.0, weight_decay=1e5),
        lambda ps: torch.optim.AdamW(ps, lr=1.0, weight_decay=1e5),
    ),
    # low_precision_adamw: here the guard never has to act (bad=()): the
    # optimizer itself never divides a first moment by a second moment that
    # underflowed. Plain Adam with eps=0 writes m / 0 = inf in both cases.
    Case(
        # bfloat16 gradients of 1e-24: g * g = 1e-48 is 0 in float32 (and in
        # bfloat16), m = 1e-25 is not; eps=0.
        "low_precision_adamw_bfloat16_second_moment_underflow",
        "bfloat16",
        {"w": [1.0, 1.0]},
        [{"w": [1e-24, 1.0]}, {"w": [1e-24, 1.0]}],
        (),
        lambda: jtx.low_precision_adamw(
            1e-3, eps=0.0, mu_dtype="bfloat16", nu_dtype="bfloat16"
        ),
        lambda ps: ttx.low_precision_adamw(
            ps, 1e-3, eps=0.0, mu_dtype="bfloat16", nu_dtype="bfloat16"
        ),
    ),
    Case(
        # float8_e4m3fn second moments with a per-tensor scale: v = 1e-3 *
        # [1, 1e-8] maps 1e-11 to 4.5e-6, below e4m3's smallest normal
        # (2**-6); stored as 0 it would make step 1's m / (0 + eps=0) = inf.
        "low_precision_adamw_float8_second_moment_underflow",
        "float32",
        {"w": [1.0, 1.0]},
        [{"w": [1.0, 1e-4]}, {"w": [1.0, 0.0]}],
        (),
        lambda: jtx.low_precision_adamw(1e-3, eps=0.0, nu_dtype="float8_e4m3fn"),
        lambda ps: ttx.low_precision_adamw(ps, 1e-3, eps=0.0, nu_dtype="float8_e4m3fn"),
    ),
]


def _run_jax(case: Case):
    dt = jnp.dtype(case.dtype)
    tx = case.jax_tx() if case.guarded else jtx.stable_optimizer(case.jax_tx())
    params = {k: jnp.asarray(v, dt) for k, v in case.params.items()}
    state = tx.init(params)
    seen = []
    for i, g in enumerate(case.grads):
        if case.lrs is not None:
            state.hyperparams["learning_rate"] = jnp.asarray(case.lrs[i], jnp.float32)
        grads = {k: jnp.asarray(v, dt) for k, v in g.items()}
        before = (params, jtx.find_skip_state(state).inner_state)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        skip = jtx.find_skip_state(state)
        chex.assert_tree_all_finite((params, skip.inner_state))
        if i in case.bad:
            chex.assert_trees_all_equal((params, skip.inner_state), before)
        seen.append((bool(skip.last_finite), bool(skip.last_grads_finite)))
    counts = (int(skip.skipped_total), int(skip.non_finite_updates))
    return params, seen, counts


def _run_torch(case: Case):
    dt = getattr(torch, case.dtype)
    params = {
        k: torch.nn.Parameter(torch.tensor(v, dtype=dt)) for k, v in case.params.items()
    }
    opt = ttx.stable_optimizer(case.torch_opt(list(params.values())))
    seen = []
    for i, g in enumerate(case.grads):
        if case.lrs is not None:
            opt.param_groups[0]["lr"] = case.lrs[i]
        for k, p in params.items():
            p.grad = torch.tensor(g[k], dtype=dt)
        before = (
            {k: p.detach().clone() for k, p in params.items()},
            _torch_state(opt),
        )
        opt.step()
        for p in params.values():
            assert torch.isfinite(p).all()
        for v in _torch_state(opt).values():
            assert torch.isfinite(v).all()
        if i in case.bad:
            for k, p in params.items():
                assert torch.equal(p.detach(), before[0][k]), (case.name, k)
            after = _torch_state(opt)
            assert after.keys() == before[1].keys()
            for k in after:
                assert torch.equal(after[k], before[1][k]), (case.name, k)
        s = opt.skip_state
        seen.append((s.last_finite, s.last_grads_finite))
    s = opt.skip_state
    return (
        {k: p.detach().float().numpy() for k, p in params.items()},
        seen,
        (s.skipped_total, s.non_finite_updates),
    )


def _torch_state(opt) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}": v.detach().clone()
        for i, p in enumerate(opt.param_groups[0]["params"])
        for k, v in opt.state.get(p, {}).items()
        if isinstance(v, torch.Tensor)
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_non_finite_update_is_never_applied_in_either_framework(case, tol):
    jparams, jseen, jcounts = _run_jax(case)
    tparams, tseen, tcounts = _run_torch(case)
    expected = [(i not in case.bad, True) for i in range(len(case.grads))]
    assert jseen == expected, "JAX: (applied, grads finite) per step"
    assert tseen == expected, "torch: (applied, grads finite) per step"
    assert jcounts == tcounts == (len(case.bad), len(case.bad))
    for k in jparams:
        np.testing.assert_allclose(
            np.asarray(jparams[k], np.float32), tparams[k], **tol(case.dtype)
        )


@pytest.mark.parametrize("case", CASES[:1], ids=lambda c: c.name)
def test_without_check_update_the_old_behaviour_writes_the_nan(case):
    # The case table is not vacuous: with the gradient check alone, each
    # framework writes the non-finite value the invariant forbids.
    tx = jtx.stable_optimizer(case.jax_tx(), check_update=False)
    params = {k: jnp.asarray(v) for k, v in case.params.items()}
    grads = {k: jnp.asarray(v) for k, v in case.grads[0].items()}
    updates, _ = tx.update(grads, tx.init(params), params)
    assert not bool(jls.all_finite(optax.apply_updates(params, updates)))
    w = torch.nn.Parameter(torch.tensor(case.params["w"]))
    opt = ttx.stable_optimizer(case.torch_opt([w]), check_update=False)
    w.grad = torch.tensor(case.grads[0]["w"])
    opt.step()
    assert not torch.isfinite(w).all()


# ---------------------------------------------------------------- train step
def _linear_batch():
    x = np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4)
    return x, np.array([0.5, -0.5], np.float32)


class _Linear(torch.nn.Module):
    def __init__(self, w: np.ndarray, dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=dtype))

    def forward(self, x):
        return x.to(self.w.dtype) @ self.w


def _jax_linear_loss(params, batch):
    x, y = batch
    pred = x.astype(params["w"].dtype) @ params["w"]
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2) * 1e-4


def _torch_linear_loss(model, batch):
    x, y = batch
    return ((model(x).float() - y) ** 2).mean() * 1e-4


def test_float16_parameters_with_default_adam_never_become_nan(tmp_path):
    """The issue's case: pure-float16 parameters, the default Adam, the train
    step of each framework and its fit. Step 0 has finite gradients and a
    non-finite Adam update (its second moment underflows, eps is 0 in
    float16): it is skipped, counted and named as a non-finite update; the
    parameters stay finite through the whole run."""
    w0 = np.full(4, 0.25, np.float32)
    x, y = _linear_batch()
    batches = [(x, y)] * 3
    # JAX: NoOpLossScale (float16 params; GradScaler refuses float16 grads).
    state = jtrain.TrainState.create(
        params={"w": jnp.asarray(w0, jnp.float16)},
        optimizer=jtx.stable_optimizer(optax.adam(1e-3)),
    )
    step = jtrain.make_train_step(_jax_linear_loss)
    state, jhist = jtrain.fit(
        state,
        step,
        [jax.device_put(b) for b in batches],
        log=jtrain.Log(tmp_path / "jax.jsonl", progress=False),
    )
    chex.assert_tree_all_finite((state.params, state.opt_state))
    model = _Linear(w0, torch.float16)
    tstep = ttrain.TrainStep(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), _torch_linear_loss
    )
    thist = ttrain.fit(
        tstep,
        [tuple(torch.from_numpy(a) for a in b) for b in batches],
        log=ttrain.Log(tmp_path / "torch.jsonl", progress=False),
    )
    assert torch.isfinite(model.w).all()
    for hist in (jhist, thist):
        assert [h["finite"] for h in hist] == [False] * 3
        assert [h["grads_finite"] for h in hist] == [True] * 3
        assert [h["skip_reason"] for h in hist] == ["non-finite update"] * 3
        assert hist[-1]["skipped_total"] == 3
    for name in ("jax", "torch"):
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["skip_reason"] == "non-finite update"
    np.testing.assert_array_equal(np.asarray(state.params["w"], np.float32), w0)
    np.testing.assert_array_equal(model.w.detach().float().numpy(), w0)


def test_update_skip_leaves_the_loss_scale_to_the_gradients():
    """Adam with eps=0 and a zero gradient entry: a finite-gradient skip. The
    loss scale grows (period 1) in both frameworks exactly as GradScaler's
    does after a step with finite gradients; a NaN batch then backs it off."""
    w0 = np.array([0.5, 0.0, 0.0, 0.25], np.float32)
    x = np.zeros((2, 4), np.float32)
    x[:, 0], x[:, 3] = 1.0, 2.0  # columns 1 and 2 give exact 0 gradients
    y = np.array([0.5, -0.5], np.float32)
    x_nan = x.copy()
    x_nan[0, 0] = np.nan
    batches = [(x, y), (x_nan, y)]
    state = jtrain.TrainState.create(
        params={"w": jnp.asarray(w0)},
        optimizer=jtx.stable_optimizer(optax.adam(1e-3, eps=0.0)),
        loss_scale=jls.DynamicLossScale(loss_scale=2.0**10, period=1),
    )
    step = jtrain.make_train_step(_jax_linear_loss)
    jrec = []
    for b in batches:
        state, m = step(state, jax.device_put(b))
        jrec.append(
            (bool(m["finite"]), bool(m["grads_finite"]), float(m["loss_scale"]))
        )
    model = _Linear(w0, torch.float32)
    tstep = ttrain.TrainStep(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0),
        _torch_linear_loss,
        scaler=tls.DynamicLossScale(loss_scale=2.0**10, period=1),
    )
    trec = []
    for b in batches:
        m = tstep(tuple(torch.from_numpy(a) for a in b))
        trec.append((m["finite"], m["grads_finite"], m["loss_scale"]))
    # step 0: update skipped, scale used 1024 and then grown (finite grads);
    # step 1: NaN gradients at 2048, then backed off.
    assert jrec == trec == [(False, True, 1024.0), (False, False, 2048.0)]
    assert float(state.loss_scale.loss_scale) == tstep.scaler.get_scale() == 1024.0
    np.testing.assert_array_equal(np.asarray(state.params["w"]), w0)
    np.testing.assert_array_equal(model.w.detach().numpy(), w0)
    assert int(jtx.find_skip_state(state.opt_state).non_finite_updates) == 1
    assert tstep.skip_state.non_finite_updates == 1


def test_jax_step_guards_the_update_without_a_skip_transform():
    # A plain optax optimizer: the step itself checks what it writes.
    state = jtrain.TrainState.create(
        params={"w": jnp.asarray([1.0, 1.0, 1.0])},
        optimizer=optax.adam(1e-3, eps=0.0),
    )

    def loss(p, b):
        return jnp.sum(p["w"] * b)

    new, m = jtrain.make_train_step(loss)(state, jnp.asarray([1.0, 0.0, 2.0]))
    assert not bool(m["finite"]) and bool(m["grads_finite"])
    chex.assert_trees_all_equal(
        (new.params, new.opt_state), (state.params, state.opt_state)
    )
    assert int(new.skipped_total) == 1


def test_fit_stop_says_the_update_not_the_gradients_was_non_finite():
    w0 = np.full(4, 0.25, np.float32)
    batch = _linear_batch()
    state = jtrain.TrainState.create(
        params={"w": jnp.asarray(w0, jnp.float16)},
        optimizer=jtx.stable_optimizer(optax.adam(1e-3)),
    )
    step = jtrain.make_train_step(_jax_linear_loss)
    kw = dict(nan_policy="stop", max_consecutive_nonfinite=1, progress=False)
    with pytest.raises(jtrain.NonFiniteError) as jerr:
        jtrain.fit(state, step, [jax.device_put(batch)], **kw)
    model = _Linear(w0, torch.float16)
    tstep = ttrain.TrainStep(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), _torch_linear_loss
    )
    with pytest.raises(ttrain.NonFiniteError) as terr:
        ttrain.fit(tstep, [tuple(torch.from_numpy(a) for a in batch)], **kw)
    for err in (jerr.value, terr.value):
        text = str(err).splitlines()
        assert text[1].startswith("its gradients were finite: the update it computed")
        assert err.history[-1]["skip_reason"] == "non-finite update"
