"""``drop_non_finite_microbatches``: keep the good micro-batches (issue 36,
item 3), JAX vs torch and against the step on the kept rows alone.

A micro-batch whose loss or scaled gradient is non-finite is dropped; the
others are averaged with their weights (``microbatch_weight``: here the
number of real rows of a masked mean), so a step equals one on the kept
rows alone. The whole step is skipped only when none is kept; the loss scale
backs off once when any micro-batch was dropped.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from conftest import has_conditional
from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms
from torchref import loss_scale as tls
from torchref import train as ttrain

_B, _K, _IN, _OUT = 8, 4, 3, 2
_LR, _CLIP = 0.1, 1.0


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(seed, bad_micro=()):
    """(x, y, mask): a masked mean over the real rows (mask 1), a different
    number of them per micro-batch; micro-batches in ``bad_micro`` hold a
    NaN in a real row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((_B, _IN)).astype(np.float32)
    y = rng.standard_normal((_B, _OUT)).astype(np.float32)
    mask = np.ones(_B, np.float32)
    mask[[3, 7]] = 0.0  # real rows per micro-batch of 2: 2, 1, 2, 1
    rows = _B // _K
    for i in bad_micro:
        x[i * rows, 0] = np.nan
        mask[i * rows] = 1.0
    return x, y, mask


def _jax_loss(p, batch):
    x, y, mask = batch
    err = jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=1)
    # A masked mean; 0 / max(0, 1) for a micro-batch without real rows.
    return jnp.sum(jnp.where(mask > 0, err, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def _torch_loss(model, batch):
    x, y, mask = batch
    err = ((model(x) - y) ** 2).sum(dim=1)
    return torch.where(mask > 0, err, 0.0).sum() / mask.sum().clamp(min=1.0)


def _jweight(b):
    return jnp.sum(b[2])


def _tweight(b):
    return b[2].sum()


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(_IN, _OUT)


def _jparams(model):
    return {
        "w": jnp.asarray(model.weight.detach().numpy().T),
        "b": jnp.asarray(model.bias.detach().numpy()),
    }


_TX = transforms.stable_optimizer(optax.sgd(_LR, momentum=0.9), max_grad_norm=_CLIP)


@functools.cache
def _jstep(k):
    return jtrain.make_train_step(
        _jax_loss,
        microbatches=k,
        drop_non_finite_microbatches=True,
        microbatch_weight=_jweight,
    )


def _jstate(model, scale=2.0**10):
    return jtrain.TrainState.create(
        params=_jparams(model),
        optimizer=_TX,
        loss_scale=jls.DynamicLossScale(scale, period=2),
    )


def _tstep(model, k=_K, drop=True, scale=2.0**10, autocast_dtype=None):
    return ttrain.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=_LR, momentum=0.9),
        _torch_loss,
        max_grad_norm=_CLIP,
        scaler=tls.DynamicLossScale(scale, period=2),
        microbatches=k,
        drop_non_finite_microbatches=drop,
        microbatch_weight=_tweight if drop else None,
        autocast_dtype=autocast_dtype,
    )


_POISON = {1: (2,), 3: (0, 3), 4: (0, 1, 2, 3), 6: (1,)}  # step -> bad micro


def _kept_rows(bad):
    rows = _B // _K
    return np.array([r for r in range(_B) if r // rows not in bad])


def test_jax_and_torch_keep_the_good_microbatches_step_for_step(tol):
    """8 steps, JAX vs torch and both vs a hand-written torch recipe on the
    kept rows alone (GradScaler, clip, SGD): parameters agree every step;
    ``finite``, ``microbatches_dropped``, the loss scale and
    ``skipped_total`` equal exactly. A step whose micro-batches are all bad
    is skipped; one with some bad is applied with the rest, and the scale
    backs off once."""
    model, ref = _model(), _model()
    state, jstep = _jstate(model), _jstep(_K)
    tstep = _tstep(model)
    opt = torch.optim.SGD(ref.parameters(), lr=_LR, momentum=0.9)
    # A scale that never moves: the kept rows' gradients are exact at any
    # power of two (the steps' own back-off is checked apart).
    scaler = tls.DynamicLossScale(2.0**10, period=10**6).make_scaler("cpu")
    for i in range(8):
        bad = _POISON.get(i, ())
        x, y, mask = _batch(i, bad)
        tm = tstep(tuple(map(torch.from_numpy, (x, y, mask))))
        state, jm = jstep(state, (x, y, mask))
        where = f"step {i}"
        assert bool(jm["finite"]) is tm["finite"] is (len(bad) < _K), where
        assert int(jm["microbatches_dropped"]) == tm["microbatches_dropped"]
        assert tm["microbatches_dropped"] == len(bad), where
        assert float(jm["loss_scale"]) == tm["loss_scale"], where
        assert int(jm["skipped_total"]) == tm["skipped_total"], where
        assert float(state.loss_scale.loss_scale) == tstep.scaler.get_scale()
        if tm["finite"]:
            np.testing.assert_allclose(float(jm["loss"]), tm["loss"], rtol=2e-6)
        # The recipe over the kept rows alone, as one batch.
        keep = _kept_rows(bad)
        if len(keep):
            xs, ys, ms = (torch.from_numpy(a[keep]) for a in (x, y, mask))
            opt.zero_grad(set_to_none=True)
            scaler.scale(_torch_loss(ref, (xs, ys, ms))).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), _CLIP)
            scaler.step(opt)
            scaler.update()
        if bad:  # one back-off, whether the step was applied or not
            assert tstep.scaler.get_scale() == tm["loss_scale"] / 2, where
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, **tol("float32_trajectory"))
        chex.assert_trees_all_close(
            jax.device_get(state.params),
            jax.device_get(_jparams(model)),
            **tol("float32_trajectory"),
        )
    assert tstep.skip_state.skipped_total == 1


def test_default_still_skips_the_whole_step():
    x, y, mask = _batch(0, (2,))
    step = jtrain.make_train_step(_jax_loss, microbatches=_K)
    # Traced only (the default step's skip is tested with the accumulation).
    _, m = jax.eval_shape(step, _jstate(_model()), (x, y, mask))
    assert "microbatches_dropped" not in m and not step.drop_non_finite_microbatches
    tm = _tstep(_model(), drop=False)(tuple(map(torch.from_numpy, (x, y, mask))))
    assert not tm["finite"] and "microbatches_dropped" not in tm


def test_jax_keep_step_has_no_conditional_nor_host_transfer():
    state, step = _jstate(_model()), _jstep(_K)
    good, bad = _batch(0), _batch(1, (1,))
    assert not has_conditional(step.lower(state, good))
    good, bad = jax.device_put((good, bad))
    state, _ = step(state, good)
    with jax.transfer_guard("disallow"):
        for b in (bad, good):
            state, m = step(state, b)
    assert int(m["skipped_total"]) == 0


def test_a_dropped_microbatch_leaves_the_batch_norm_statistics_alone():
    """Its forward's running statistics (NaN) are put back; the kept
    micro-batches' updates stay, as k forwards over the kept rows alone."""

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(_IN, _OUT), torch.nn.BatchNorm1d(2))

    def loss(m, b):
        return (m(b[0]) ** 2).mean()

    x = torch.from_numpy(_batch(0, (1,))[0])
    ours, ref = net(), net()
    step = ttrain.TrainStep(
        ours,
        torch.optim.SGD(ours.parameters(), lr=0.0),
        loss,
        microbatches=_K,
        drop_non_finite_microbatches=True,
    )
    m = step((x,))
    assert m["finite"] and m["microbatches_dropped"] == 1
    with torch.no_grad():
        for i in (0, 2, 3):
            ref(x[2 * i : 2 * i + 2])
    for a, b in zip(ours.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        (dict(drop_non_finite_microbatches=1), TypeError, "must be True or False"),
        (dict(drop_non_finite_microbatches=True), ValueError, "needs microbatches"),
        (dict(microbatches=2, microbatch_weight=3), TypeError, "a callable"),
        (dict(microbatches=2, microbatch_weight=len), ValueError, "only with"),
    ],
)
def test_bad_options_are_refused_alike(kwargs, error, text):
    with pytest.raises(error, match=text) as j:
        jtrain.make_train_step(_jax_loss, **kwargs)
    model = _model()
    with pytest.raises(error, match=text) as t:
        ttrain.TrainStep(
            model, torch.optim.SGD(model.parameters(), lr=0.1), _torch_loss, **kwargs
        )
    assert str(j.value) == str(t.value)


# ------------------------------------------- accumulate_gradients, both sides
_BAD_MICRO = {1, 6, 7, 8}  # window 0 keeps 2 of 3, window 2 none


def test_accumulate_gradients_keeps_the_good_micro_gradients_alike(tol):
    """4 windows of k=3 micro-gradients, JAX vs torch vs a hand-written mean
    over the kept ones: one NaN micro-gradient is dropped (the window is
    applied), a window of three NaN ones is skipped once."""
    k = 3
    jtx = transforms.accumulate_gradients(
        transforms.stable_optimizer(optax.sgd(_LR), max_grad_norm=_CLIP),
        k,
        drop_non_finite_microbatches=True,
    )
    model, ref = _model(), _model()
    params = _jparams(model)
    jstate = jtx.init(params)
    update, grad = jax.jit(jtx.update), jax.jit(jax.grad(_jax_loss))
    topt = ttrain_accumulate(model, k)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=_LR)
    for window in range(4):
        kept = []
        for j in range(k):
            micro = window * k + j
            bad = micro in _BAD_MICRO
            x, y, mask = _batch(micro, (0,) if bad else ())
            g = grad(params, (x, y, mask))
            if micro == 0:  # selects only: no conditional in the update
                assert not has_conditional(update.lower(g, jstate, params))
            updates, jstate = update(g, jstate, params)
            params = optax.apply_updates(params, updates)
            batch = tuple(map(torch.from_numpy, (x, y, mask)))
            topt.zero_grad()
            _torch_loss(model, batch).backward()
            topt.step()
            if not bad:
                kept.append(batch)
        if kept:  # the mean of the kept micro-gradients, by hand
            ref_opt.zero_grad(set_to_none=True)
            for b in kept:
                (_torch_loss(ref, b) / len(kept)).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), _CLIP)
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, **tol("float32"))
        chex.assert_trees_all_close(
            jax.device_get(params), jax.device_get(_jparams(model)), **tol("float32")
        )
    assert int(jstate.dropped_total) == topt.dropped_total == 4
    skip = transforms.find_skip_state(jstate)
    assert int(skip.skipped_total) == topt.skip_state.skipped_total == 1


def ttrain_accumulate(model, k):
    from torchref import transforms as ttransforms

    return ttransforms.accumulate_gradients(
        ttransforms.stable_optimizer(
            torch.optim.SGD(model.parameters(), lr=_LR), max_grad_norm=_CLIP
        ),
        k,
        drop_non_finite_microbatches=True,
    )


def test_fit_records_count_the_dropped_microbatches_alike():
    x, y, mask = _batch(0, (2,))
    data = [(x, y, mask)] * 2
    _, hist = jtrain.fit(_jstate(_model()), _jstep(_K), data, progress=False)
    thist = ttrain.fit(
        _tstep(_model()),
        [tuple(map(torch.from_numpy, b)) for b in data],
        progress=False,
    )
    assert [r["microbatches_dropped"] for r in hist] == [1, 1]
    assert [r["microbatches_dropped"] for r in thist] == [1, 1]
    assert set(hist[0]) == set(thist[0])


def test_a_float16_overflow_drops_only_its_microbatch_alike(tol):
    """No NaN in the data: float16 compute (jmp policy / CPU autocast) at a
    scale of 2**15, one micro-batch with inputs 300x larger overflows its
    scaled backward. It alone is dropped, in both frameworks; the step is
    applied with the rest and the scale backs off."""
    x, y, mask = _batch(0)
    x[4:6] *= 300.0  # micro-batch 2
    model = _model()
    state = _jstate(model, scale=2.0**15)
    jstep = jtrain.make_train_step(
        _jax_loss,
        microbatches=_K,
        policy="p=f32,c=f16,o=f32",
        drop_non_finite_microbatches=True,
        microbatch_weight=_jweight,
    )
    tstep = _tstep(model, scale=2.0**15, autocast_dtype=torch.float16)
    state, jm = jstep(state, (x, y, mask))
    tm = tstep(tuple(map(torch.from_numpy, (x, y, mask))))
    assert int(jm["microbatches_dropped"]) == tm["microbatches_dropped"] == 1
    assert bool(jm["finite"]) and tm["finite"]
    assert float(state.loss_scale.loss_scale) == tstep.scaler.get_scale() == 2.0**14
    chex.assert_trees_all_close(
        jax.device_get(state.params), jax.device_get(_jparams(model)), **tol("float16")
    )


def test_jax_a_dropped_microbatch_leaves_the_model_state_alone():
    """The JAX twin of the batch-norm test: a model state (a running sum of
    each micro-batch's mean input) takes the kept micro-batches only."""

    def loss(p, ms, b):
        x = b[0]
        new = {"sum": ms["sum"] + jnp.mean(x, axis=0)}
        return jnp.mean((x @ p["w"]) ** 2), new

    step = jtrain.make_train_step(
        loss, has_state=True, microbatches=_K, drop_non_finite_microbatches=True
    )
    state = jtrain.TrainState.create(
        params={"w": jnp.zeros((_IN, _OUT))},
        optimizer=_TX,
        model_state={"sum": jnp.zeros(_IN)},
    )
    x = _batch(0, (1,))[0]
    state, m = step(state, (x,))
    assert bool(m["finite"]) and int(m["microbatches_dropped"]) == 1
    kept = sum(x[2 * i : 2 * i + 2].mean(axis=0) for i in (0, 2, 3))
    np.testing.assert_allclose(state.model_state["sum"], kept, rtol=1e-6)


def test_jax_refuses_the_option_with_axis_name():
    with pytest.raises(ValueError, match=r"not supported with axis_name \('data'\)"):
        jtrain.make_train_step(
            _jax_loss,
            axis_name="data",
            microbatches=2,
            drop_non_finite_microbatches=True,
        )
