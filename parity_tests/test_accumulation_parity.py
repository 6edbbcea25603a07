"""Gradient accumulation: ``make_train_step(..., microbatches=k)`` (JAX) and
``TrainStep(..., microbatches=k)`` (torch) against GradScaler's recipe.

torch's recipe, per optimizer step: ``scaler.scale(loss_i / k).backward()``
for each of the k micro-batches (the gradients add up in ``.grad``), then
``unscale_``, ``clip_grad_norm_``, ``scaler.step``, ``scaler.update``: one
finiteness check, one clip, one skip decision and one loss-scale update for
the whole step, whichever micro-batch went bad. The JAX step does the same
in one jitted computation (a `lax.scan` over the micro-batches, the scaled
gradients summed in float32; no `conditional`, nothing read on the host).
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

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

_B, _K, _IN, _HID, _OUT = 8, 4, 5, 16, 3
_LR, _MOMENTUM, _CLIP = 0.05, 0.9, 1.0


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only spin (see trajectory test)
    yield
    torch.set_num_threads(n)


class _TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(_IN, _HID)
        self.fc2 = torch.nn.Linear(_HID, _OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _torch_loss(model, batch):
    x, y = batch
    return ((model(x).float() - y) ** 2).mean()


def _jax_params(model):
    return {
        "w1": jnp.asarray(model.fc1.weight.detach().numpy().T),
        "b1": jnp.asarray(model.fc1.bias.detach().numpy()),
        "w2": jnp.asarray(model.fc2.weight.detach().numpy().T),
        "b2": jnp.asarray(model.fc2.bias.detach().numpy()),
    }


def _jax_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"] + p["b2"]).astype(jnp.float32) - y) ** 2)


def _batch(seed, bad_micro=(), scale=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((_B, _IN)) * scale).astype(np.float32)
    y = rng.standard_normal((_B, _OUT)).astype(np.float32)
    rows = _B // _K
    for i in bad_micro:
        x[i * rows, 1] = np.nan  # one NaN in micro-batch i only
    return x, y


@functools.cache
def _jstep(microbatches, policy=None):
    # One jitted step per configuration for the whole module (compiling is
    # what costs here).
    return jtrain.make_train_step(_jax_loss, microbatches=microbatches, policy=policy)


_TX = transforms.stable_optimizer(
    optax.sgd(_LR, momentum=_MOMENTUM), max_grad_norm=_CLIP
)


def _jax_setup(model, scale, period, microbatches, policy=None):
    state = jtrain.TrainState.create(
        params=_jax_params(model),
        optimizer=_TX,
        loss_scale=jls.DynamicLossScale(scale, period=period),
    )
    return state, _jstep(microbatches, policy)


def _torch_setup(model, scale, period, microbatches, autocast_dtype=None):
    return ttrain.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=_LR, momentum=_MOMENTUM),
        _torch_loss,
        max_grad_norm=_CLIP,
        scaler=tls.DynamicLossScale(scale, period=period),
        autocast_dtype=autocast_dtype,
        microbatches=microbatches,
    )


# ---------------------------------------------------------------- the recipe
def test_torch_microbatches_are_gradscalers_accumulation_recipe():
    """TrainStep(microbatches=4) == the hand-written recipe, bit for bit, over
    steps with a NaN micro-batch, back-off and growth (period 2)."""
    ours, ref = _TorchMLP(), _TorchMLP()
    step = _torch_setup(ours, 2.0**10, 2, _K)
    opt = torch.optim.SGD(ref.parameters(), lr=_LR, momentum=_MOMENTUM)
    scaler = tls.DynamicLossScale(2.0**10, period=2).make_scaler("cpu")
    for i, bad in enumerate([(), (), (2,), (), (), ()]):
        x, y = (torch.from_numpy(a) for a in _batch(i, bad))
        m = step((x, y))
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(_K), y.chunk(_K), strict=True):
            scaler.scale(_torch_loss(ref, (xs, ys)) / _K).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), _CLIP)
        scaler.step(opt)
        scaler.update()
        assert m["finite"] is (not bad)
        assert m["loss_scale"] * (0.5 if bad else 1) <= scaler.get_scale() * 2
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert step.scaler.get_scale() == scaler.get_scale()
    assert step.skip_state.skipped_total == 1


def test_a_finite_step_gives_the_full_batch_gradient(tol):
    # A mean loss over equal micro-batches: the mean of the k micro-batch
    # means is the full batch's mean, so the gradients agree to float32
    # rounding in both frameworks.
    k = _K
    x, y = _batch(0)
    model = _TorchMLP()
    state, whole = _jax_setup(model, 2.0**10, 2, None)
    _, micro = _jax_setup(model, 2.0**10, 2, k)
    g_whole = whole.grads(state, (x, y))
    g_micro = micro.grads(state, (x, y))
    chex.assert_trees_all_close(g_micro, g_whole, **tol("float32"))

    grads = {}
    for kk in (None, k):
        tmodel = _TorchMLP()
        tstep = _torch_setup(tmodel, 2.0**10, 2000, kk)
        tstep.clip = None  # keep the raw gradients on .grad to compare
        tstep((torch.from_numpy(x), torch.from_numpy(y)))
        grads[kk] = [p.grad.clone() for p in tmodel.parameters()]
    for a, b in zip(grads[k], grads[None], strict=True):
        torch.testing.assert_close(a, b, **tol("float32"))


# -------------------------------------------------------- JAX vs torch parity
_POISON = {3: (2,), 7: (0,), 8: (3,)}  # step -> micro-batches with a NaN


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_trajectory_parity_with_nan_microbatches_and_overflow(precision, tol):
    """12 steps of k=4 micro-batches, JAX vs torch: ``finite``, the loss
    scale and ``skipped_total`` equal exactly after every step, parameters
    to the dtype's tolerance. float32: NaN micro-batches (one step skipped
    per bad step, whichever micro-batch), back-off and growth (period 2).
    float16 compute (jmp policy / CPU autocast) from GradScaler's 2**16: the
    scale grows every 2 steps until the scaled float16 backward overflows
    (no NaN input: a real overflow, at 2**18 here), backs off, grows again."""
    fp16 = precision == "float16"
    steps, scale = (10, 2.0**16) if fp16 else (12, 2.0**10)
    model = _TorchMLP()
    state, jstep = _jax_setup(
        model, scale, 2, _K, policy="p=f32,c=f16,o=f32" if fp16 else None
    )
    tstep = _torch_setup(model, scale, 2, _K, torch.float16 if fp16 else None)
    finite, scales = [], []
    for i in range(steps):
        x, y = _batch(i, () if fp16 else _POISON.get(i, ()), scale=3.0)
        before = state.params
        tm = tstep((torch.from_numpy(x), torch.from_numpy(y)))
        state, jm = jstep(state, (x, y))
        where = f"{precision} step {i}"
        assert bool(jm["finite"]) is tm["finite"], where
        assert float(jm["loss_scale"]) == tm["loss_scale"], where
        assert int(jm["skipped_total"]) == tm["skipped_total"], where
        if not tm["finite"]:
            chex.assert_trees_all_equal(state.params, before)
        chex.assert_tree_all_finite((state.params, state.opt_state))
        chex.assert_trees_all_close(
            jax.device_get(state.params),
            jax.device_get(_jax_params(model)),
            **tol("float16" if fp16 else "float32_trajectory"),
        )
        finite.append(tm["finite"])
        scales.append(tm["loss_scale"])
    moves = np.sign(np.diff(scales))
    assert (moves > 0).any() and (moves < 0).any(), scales
    if fp16:  # overflow without any NaN input, and training went on
        assert not all(finite) and finite[-1], finite
    else:  # each bad step skipped once, whichever micro-batch held the NaN
        assert [i for i, f in enumerate(finite) if not f] == sorted(_POISON)


# --------------------------------------------------- the compiled JAX step
def test_jax_microbatch_step_has_no_conditional_nor_host_transfer():
    model = _TorchMLP()
    state, step = _jax_setup(model, 2.0**10, 2, _K)
    batch, bad = _batch(0), _batch(1, (1,))
    assert not has_conditional(step.lower(state, batch))
    batch, bad = jax.device_put((batch, bad))
    state, _ = step(state, batch)  # compiled (the module's step)
    with jax.transfer_guard("disallow"):
        for b in (bad, batch):
            state, m = step(state, b)
    assert int(m["skipped_total"]) == 1


# ------------------------------------------- model state, aux, bad arguments
def test_model_state_is_threaded_and_aux_combined_alike():
    """The model state passes through the k micro-batches in order (a
    counter of forwards moves by k per step; a skipped step restores it in
    both), and aux is combined by one rule: floats averaged, booleans ANDed,
    integers summed."""

    def jloss(w, ms, x):
        aux = {"mean": jnp.mean(x), "ok": jnp.all(x < 5), "n": jnp.sum(x > 0)}
        return (jnp.sum(w * x) / x.shape[0], aux), {"calls": ms["calls"] + 1}

    jstep = jtrain.make_train_step(jloss, has_state=True, has_aux=True, microbatches=2)
    state = jtrain.TrainState.create(
        params=jnp.zeros(()),
        optimizer=optax.sgd(0.1),
        model_state={"calls": jnp.zeros((), jnp.int32)},
    )

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    tmodel = Counter()

    def tloss(m, x):
        m.calls += 1
        aux = {"mean": x.mean(), "ok": bool((x < 5).all()), "n": int((x > 0).sum())}
        return (m.w * x).sum() / x.shape[0], aux

    tstep = ttrain.TrainStep(
        tmodel, torch.optim.SGD([tmodel.w], lr=0.1), tloss, microbatches=2
    )
    x = np.array([1.0, 2.0, -3.0, 6.0], np.float32)
    state, jm = jstep(state, jnp.asarray(x))
    tm = tstep(torch.from_numpy(x))
    assert int(state.model_state["calls"]) == int(tmodel.calls) == 2
    assert jax.device_get(jm["aux"]) == {"mean": 1.5, "ok": False, "n": 3}
    assert {k: float(v) for k, v in tm["aux"].items()} == {
        "mean": 1.5,
        "ok": 0.0,
        "n": 3.0,
    }
    x[0] = np.nan
    state, jm = jstep(state, jnp.asarray(x))
    tm = tstep(torch.from_numpy(x))
    assert not bool(jm["finite"]) and not tm["finite"]
    assert int(state.model_state["calls"]) == int(tmodel.calls) == 2


@pytest.mark.parametrize(
    ("k", "error"),
    [
        (0, ValueError),
        (-2, ValueError),
        (2.0, TypeError),
        (True, TypeError),
        ("2", TypeError),
    ],
)
def test_bad_microbatches_are_refused_alike(k, error):
    with pytest.raises(error, match="microbatches must be None or an int >= 1") as j:
        jtrain.make_train_step(_jax_loss, microbatches=k)
    model = _TorchMLP()
    with pytest.raises(error, match="microbatches must be None or an int >= 1") as t:
        ttrain.TrainStep(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            _torch_loss,
            microbatches=k,
        )
    assert str(j.value) == str(t.value)


def test_a_batch_that_k_does_not_divide_is_refused_alike():
    model = _TorchMLP()
    state, jstep = _jax_setup(model, 1.0, 2, 3)
    tstep = _torch_setup(model, 1.0, 2, 3)
    x, y = _batch(0)
    with pytest.raises(ValueError, match="divisible by 3") as j:
        jstep(state, (x, y))
    with pytest.raises(ValueError, match="divisible by 3") as t:
        tstep((torch.from_numpy(x), torch.from_numpy(y)))
    assert str(j.value) == str(t.value)
    assert "batch leaf [0] has shape (8, 5)" in str(j.value)


def test_fit_runs_microbatch_steps_with_the_same_record_keys():
    model = _TorchMLP()
    data = [_batch(i, (1,) if i == 2 else ()) for i in range(4)]
    keys = set()
    for k in (None, _K):
        state, step = _jax_setup(model, 2.0**10, 2, k)
        _, hist = jtrain.fit(
            state,
            step,
            data,
            log=None,
            nan_policy=jtrain.NanPolicy.skip(locate_first=0),
        )
        thist = ttrain.fit(
            _torch_setup(_TorchMLP(), 2.0**10, 2, k),
            [tuple(map(torch.from_numpy, b)) for b in data],
            log=None,
            nan_policy=ttrain.NanPolicy.skip(locate_first=0),
        )
        assert [r["finite"] for r in hist] == [r["finite"] for r in thist]
        keys.add(frozenset(hist[2]))
        keys.add(frozenset(thist[2]))
    assert len(keys) == 1, keys


def test_microbatches_inside_shard_map_equal_one_device():
    # axis_name and microbatches together: each replica accumulates its own
    # micro-batches (the carry marked varying), then the sum is psum-ed.
    from jax.sharding import PartitionSpec as P

    from jaxstable import distributed

    mesh = distributed.make_mesh(1)
    loss = lambda p, b: jnp.mean((p - b) ** 2)  # noqa: E731
    dp = jtrain.make_train_step(loss, axis_name="data", microbatches=2)
    dp = jax.jit(jax.shard_map(dp, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    one = jtrain.make_train_step(loss, microbatches=2)
    state = jtrain.TrainState.create(
        params=jnp.zeros(2), optimizer=_TX, loss_scale=jls.DynamicLossScale()
    )
    batch = jnp.arange(8.0).reshape(4, 2)
    a, ma = dp(
        distributed.shard_state(state, mesh), distributed.shard_batch(batch, mesh)
    )
    b, mb = one(state, batch)
    chex.assert_trees_all_equal((a.params, ma["loss"]), (b.params, mb["loss"]))
