"""The first hour: schedules and the skip, NaN hyperparameters, and the
early errors that name their fix (docs/first_hour.md), in both packages."""

import chex
import jax.numpy as jnp
import optax
import pytest
import torch

from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import train as ttrain
from torchref import transforms as ttx

# tiny steps compiled one per test: with fewer XLA optimisations (conftest.py)
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

_STEP = jtrain.make_train_step(lambda p, b: jnp.sum(p * b))


def _around(schedule):  # inject(skip(sgd))
    return optax.inject_hyperparams(
        lambda learning_rate: jtx.stable_optimizer(optax.sgd(learning_rate))
    )(learning_rate=schedule)


def _inside(schedule):  # skip(inject(sgd))
    return jtx.stable_optimizer(
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    )


def _plain(schedule):  # inject(sgd), guarded by the step itself
    return optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)


def _count(opt_state):
    if isinstance(opt_state, jtx.SkipNonFiniteState):
        opt_state = opt_state.inner_state
    return int(opt_state.count)


@pytest.mark.parametrize(
    ("make", "lr_after", "count_after"),
    [(_around, 0.2, 2), (_inside, 0.1, 1), (_plain, 0.1, 1)],
)
def test_where_inject_hyperparams_sits_decides_if_the_schedule_advances(
    make, lr_after, count_after
):
    state = jtrain.TrainState.create(
        params=jnp.zeros(1), optimizer=make(lambda c: 0.1 * (c + 1))
    )
    state, m = _STEP(state, jnp.array([jnp.nan]))
    assert not bool(m["finite"])
    state, m = _STEP(state, jnp.ones(1))  # params = -lr of this step
    assert bool(m["finite"])
    assert float(-state.params[0]) == pytest.approx(lr_after)
    assert _count(state.opt_state) == count_after


@pytest.mark.parametrize("make", [_around, _inside, _plain])
def test_a_nan_hyperparameter_never_stays_in_the_state(make):
    state = jtrain.TrainState.create(
        params=jnp.zeros(1), optimizer=make(lambda c: jnp.where(c == 1, jnp.nan, 0.1))
    )
    finite = []
    for _ in range(3):
        state, m = _STEP(state, jnp.ones(1))
        finite.append(bool(m["finite"]))
        chex.assert_tree_all_finite((state.params, state.opt_state))
    # Around the skip the schedule moves past the NaN; inside (and with the
    # step's own guard) it stays at that count: every step is skipped there.
    assert finite == ([True, False, True] if make is _around else [True, False, False])


def test_the_factory_instead_of_the_optimizer_names_the_fix():
    fix = r"call it: optax\.adam\(1e-3\)"
    for build in (
        lambda: jtx.stable_optimizer(optax.adam),
        lambda: jtx.skip_non_finite(optax.adam, max_consecutive=3),
        lambda: jtrain.TrainState.create(params=jnp.zeros(1), optimizer=optax.adam),
    ):
        with pytest.raises(TypeError, match=fix):
            build()
    with pytest.raises(TypeError, match="got int"):
        jtx.stable_optimizer(3)
    model = torch.nn.Linear(2, 1)
    fix = r"construct it: torch\.optim\.Adam\(model\.parameters\(\), lr=1e-3\)"
    for build in (
        lambda: ttx.stable_optimizer(torch.optim.Adam),
        lambda: ttx.skip_non_finite(torch.optim.Adam),
        lambda: ttrain.TrainStep(model, torch.optim.Adam, lambda m, b: m(b).sum()),
    ):
        with pytest.raises(TypeError, match=fix):
            build()


def test_a_policy_that_states_another_param_dtype_is_refused_alike():
    state = jtrain.TrainState.create(
        params={"w": jnp.zeros(2)}, optimizer=optax.sgd(0.1)
    )
    loss = lambda p, b: jnp.sum(p["w"] * b)  # noqa: E731
    with pytest.raises(ValueError, match="'mixed_bfloat16'") as j:
        jtrain.make_train_step(loss, policy="bf16")(state, jnp.ones(2))
    assert "params leaf ['w'] is float32" in str(j.value)
    assert "key=dtype pairs" in str(j.value)  # the grammar
    _, m = jtrain.make_train_step(loss, policy="mixed_bfloat16")(state, jnp.ones(2))
    assert bool(m["finite"])
    bf16 = state.replace(params={"w": jnp.zeros(2, jnp.bfloat16)})
    bf16 = bf16.replace(opt_state=optax.sgd(0.1).init(bf16.params))
    _, m = jtrain.make_train_step(loss, policy="bf16")(bf16, jnp.ones(2))
    assert bool(m["finite"])

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'mixed_bfloat16'") as t:
        ttrain.TrainStep(
            model, opt, lambda m, b: m(b).sum(), autocast_dtype="p=bf16,c=bf16"
        )
    assert "params leaf weight is float32" in str(t.value)
    same = str(t.value).replace("weight", "['w']").replace("'p=bf16,c=bf16'", "'bf16'")
    assert same == str(j.value)
    # A bare dtype name is the autocast dtype there (the argument's meaning).
    assert (
        ttrain.TrainStep(
            model, opt, lambda m, b: m(b).sum(), autocast_dtype="bf16"
        ).autocast_dtype
        is torch.bfloat16
    )
