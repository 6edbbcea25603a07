"""jaxstable.diagnostics.locate: one case per phase, each failing for a real
numerical reason (no NaN constant planted in a layer), plus the finite step,
the untouched hot path, bounded memory and the wiring into fit."""

from __future__ import annotations

import json
import re

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import io_callback

from jaxstable import diagnostics, train
from jaxstable import loss_scale as jls
from jaxstable._src import locate_scopes, locate_trace

FP16 = "params=float32,compute=float16,output=float32"


class Net(nnx.Module):
    """Three Linear layers (``layers.0..2``), ReLU between them."""

    def __init__(self, scales=(2.0, 20.0, 10.0)):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in scales])
        for layer, v in zip(self.layers, scales, strict=True):
            layer.kernel[...] = jnp.full((8, 8), v)

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


def _net_step(policy=FP16):
    graphdef, params = nnx.split(Net())

    def loss_fn(p, b):
        out = nnx.merge(graphdef, p)(b["x"])
        return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)

    step = train.make_train_step(loss_fn, policy=policy)
    state = train.TrainState.create(params=params, optimizer=optax.sgd(0.1))
    return step, state


def _xy(x=None):
    return {"x": jnp.ones((4, 8)) if x is None else x, "y": jnp.zeros((4, 8))}


def db_reference_step(x, y, k=50.0):
    """The DBNet references' step function (seeds/002)."""
    return 1.0 / (1.0 + jnp.exp(-k * (x - y)))


def _grid():
    g = np.linspace(0.0, 1.0, 11, dtype=np.float32)
    return np.meshgrid(g, g)


def _locate(step, state, batch):
    """`locate`, checked against the real jitted step: None exactly when the
    step was applied; phase "update" exactly when the step's gradients were
    finite but it was skipped for a non-finite update. Either way the step
    wrote nothing non-finite (the guard's invariant)."""
    loc = diagnostics.locate(step, state, batch)
    new, metrics = step(state, batch)
    if loc is None or loc.phase != "params":
        assert not diagnostics.non_finite_report((new.params, new.opt_state))
    if loc is None:
        assert bool(metrics["finite"])
    elif loc.phase == "update":
        assert not bool(metrics["finite"]) and bool(metrics["grads_finite"])
    else:
        assert not bool(metrics["finite"])
    return loc


def test_input_nan_in_batch():
    step, state = _net_step(policy=None)
    x = jnp.ones((4, 8)).at[1, 2].set(jnp.nan)
    loc = _locate(step, state, _xy(x))
    assert (loc.phase, loc.path, loc.op) == ("input", "x", None)
    assert loc.detail == "NaN in batch['x'] (1 of 32 values)"


def test_params_already_non_finite():
    step, state = _net_step(policy=None)
    # An overflow of a float16 restore: 1e5 does not fit float16.
    bad = state.params["layers"][1]["bias"][...].astype(jnp.float16) + 1e5
    state.params["layers"][1]["bias"][...] = bad.astype(jnp.float32)
    loc = _locate(step, state, _xy())
    assert (loc.phase, loc.path) == ("params", "layers.1.bias")


def test_forward_fp16_overflow_in_one_named_layer():
    # Activations grow 16 -> 2560 -> 204800: only the last layer passes
    # float16's 65504.
    step, state = _net_step()
    loc = _locate(step, state, _xy())
    assert (loc.phase, loc.path, loc.op) == ("forward", "layers.2", "matmul")
    assert loc.detail == (
        "float16 overflow: max |x| = 2.05e+05 > 65504 in the output of matmul "
        "in layers.2"
    )
    assert loc.input_max_abs[0] == 2560.0  # the layer's input was finite
    assert loc.source.endswith("in __call__") and "test_locate.py" in loc.source


def test_loss_log_of_zero_probability():
    # Confident logits: softmax underflows to exactly 0 for the true class.
    def loss_fn(p, b):
        probs = jax.nn.softmax(b["x"] @ p["w"], axis=-1)
        return -jnp.mean(jnp.log(jnp.take_along_axis(probs, b["y"], -1)))

    step = train.make_train_step(loss_fn)
    w = jnp.array([[200.0, -200.0]])
    state = train.TrainState.create(params={"w": w}, optimizer=optax.sgd(0.1))
    batch = {"x": jnp.ones((3, 1)), "y": jnp.ones((3, 1), jnp.int32)}
    loc = _locate(step, state, batch)
    assert (loc.phase, loc.path, loc.op) == ("loss", None, "log")
    assert loc.detail == "log of 0 in the loss"


def test_backward_sqrt_at_zero():
    # The Euclidean distance at distance 0: finite value, d sqrt/dx = 1/0.
    step = train.make_train_step(lambda p, b: jnp.sqrt(jnp.sum((p["w"] - b) ** 2)))
    state = train.TrainState.create(params={"w": jnp.ones(3)}, optimizer=optax.sgd(1))
    loc = _locate(step, state, jnp.ones(3))
    assert (loc.phase, loc.path, loc.op) == ("backward", "w", "div")
    assert "division by 0 in the loss" in loc.detail


def test_backward_dbnet_step_in_fp16_names_the_step_function():
    # seeds/002: exp(50) is inf in float16; 1 / (1 + inf) = 0 keeps the loss
    # finite, the gradient 0 * inf is NaN.
    def loss_fn(p, b):
        x, y = p["x"].astype(jnp.float16), b.astype(jnp.float16)
        return jnp.mean(db_reference_step(x, y)).astype(jnp.float32)

    xs, ys = _grid()
    step = train.make_train_step(loss_fn)
    state = train.TrainState.create(
        params={"x": jnp.asarray(xs)}, optimizer=optax.sgd(1)
    )
    loc = _locate(step, state, jnp.asarray(ys))
    assert (loc.phase, loc.path, loc.op) == ("backward", "x", "exp")
    assert "in db_reference_step" in loc.source
    assert "float16 overflow" in loc.detail and "exp of up to 50 > 11.09" in loc.detail


def _scale_case(scale):
    def loss_fn(p, b):
        return jnp.mean(((b[0] @ p["w"]).astype(jnp.float32) - b[1]) ** 2)

    step = train.make_train_step(loss_fn, policy=FP16)
    state = train.TrainState.create(
        params={"w": jnp.ones((4, 2))},
        optimizer=optax.sgd(0.1),
        loss_scale=jls.StaticLossScale(scale),
    )
    return step, state, (jnp.ones((4, 4)), jnp.zeros((4, 2)))


def test_loss_scale_overflow_is_benign():
    # dL/dout = 2 * 4 / 8 = 1; times 2**24 it passes float16's 65504.
    step, state, batch = _scale_case(2.0**24)
    loc = _locate(step, state, batch)
    assert (loc.phase, loc.path, loc.op) == ("loss_scale", "w", "cast")
    assert loc.detail == (
        "gradient overflow at loss scale 1.67772e+07, finite at scale 1 "
        "(benign: the scale backs off)"
    )
    assert _locate(*_scale_case(2.0**10)) is None
    loc = diagnostics.locate(*_scale_case(2.0**24))
    # re-run at 2**24 (non-finite again), at 1, and at 1 again (finite again)
    assert (loc.reproduced, loc.reruns, loc.reproduced_count) == (True, 2, 2)


def _flaky_locate(bad_calls):
    """``sqrt(w * f) * x`` with ``f = 0`` on the listed calls of a host
    callback, else 1: a kernel that misbehaves on some calls only (torchvision
    FCOS in bf16 on a CPU gets a NaN gradient in 4 of 6 runs of one step).
    The loss is finite (0); the gradient ``f / (2 sqrt(w f))`` is 0/0 = NaN.
    Calls: the jitted step locate runs first to check it, then locate's
    op-by-op runs."""
    calls = [0]

    def factor():
        calls[0] += 1
        bad = bad_calls == "all" or calls[0] in bad_calls
        return np.float32(0.0 if bad else 1.0)

    def loss_fn(p, x):
        f = io_callback(factor, jax.ShapeDtypeStruct((), jnp.float32))
        return jnp.sum(jnp.sqrt(p["w"] * f) * x)

    state = train.TrainState.create(
        params={"w": jnp.ones(3)},
        optimizer=optax.sgd(0.1),
        loss_scale=jls.DynamicLossScale(),
    )
    loc = diagnostics.locate(train.make_train_step(loss_fn), state, jnp.ones(3))
    return loc, calls[0]


# issue 35 item 7: a fault on the compiled check and the first op-by-op run
# only was called "gradient overflow at loss scale 65536, finite at scale 1
# (benign)" from one op-by-op run at each scale.
@pytest.mark.parametrize(
    ("bad_calls", "runs", "counts"),
    [
        ({1, 2}, 3, (1, 0)),  # the re-run at 65536 is finite
        ({1, 2, 3, 5}, 5, (2, 1)),  # at 65536 twice; finite at scale 1, then not
    ],
)
def test_a_fault_that_does_not_reproduce_is_not_given_a_cause(bad_calls, runs, counts):
    loc, calls = _flaky_locate(bad_calls)
    assert calls == runs
    assert (loc.phase, loc.path, loc.op) == ("backward", "w", "div")
    assert (loc.reproduced, loc.reruns, loc.reproduced_count) == (False, *counts)
    assert loc.detail == (
        "non-finite in phase 'backward' at w, op div at loss scale 65536, then "
        "did not reproduce on re-run: suspect non-determinism or hardware "
        f"({counts[1]} of {counts[0]} re-runs from the same state and batch at the "
        "same loss scale gave the result of the run they repeated)"
    )
    assert "benign" not in loc.detail and "division" not in loc.detail


def test_a_fault_that_reproduces_is_given_its_cause():
    loc, calls = _flaky_locate("all")
    assert calls == 4  # compiled; op by op at 65536 twice, at 1 (not benign)
    assert (loc.phase, loc.path, loc.op) == ("backward", "w", "div")
    assert (loc.reproduced, loc.reruns, loc.reproduced_count) == (True, 1, 1)
    assert loc.detail.startswith("NaN in the gradient of w, the loss finite;")


def _adam_case(x):
    step = train.make_train_step(lambda p, b: jnp.sum(p["w"] * b).astype(jnp.float32))
    state = train.TrainState.create(
        params={"w": jnp.ones(3, jnp.float16)}, optimizer=optax.adam(1e-3)
    )
    return step, state, jnp.full(3, x, jnp.float16)


def test_update_adam_in_fp16_divides_by_zero():
    # g = 1e-4: g**2 = 1e-8 underflows to 0 in float16, and so does eps=1e-8.
    loc = _locate(*_adam_case(1e-4))
    assert (loc.phase, loc.path, loc.op) == ("update", "w", "div")
    assert loc.detail.startswith("Adam's second moment underflowed to 0 in float16")


def test_finite_step_gives_none():
    assert _locate(*_adam_case(1.0)) is None
    step, state = _net_step(policy=None)
    assert _locate(step, state, _xy()) is None


def test_linen_module_paths():
    class Block(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(8, name="lin")(x)

    class Model(linen.Module):
        @linen.compact
        def __call__(self, x):
            for i, s in enumerate((2.0, 20.0, 10.0)):
                x = Block(name=f"blocks_{i}")(x * s)
            return x

    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    params = jax.tree.map(lambda p: jnp.ones_like(p) if p.ndim == 2 else p, params)

    def loss_fn(p, b):
        return jnp.mean(model.apply({"params": p}, b).astype(jnp.float32) ** 2)

    step = train.make_train_step(loss_fn, policy=FP16)
    state = train.TrainState.create(params=params, optimizer=optax.sgd(0.1))
    loc = _locate(step, state, jnp.ones((2, 8)))
    assert (loc.phase, loc.path, loc.op) == ("forward", "blocks_2.lin", "matmul")


def _keras():
    """Keras 3 on the JAX backend, or a skip (not installed, or already
    imported with another backend in this process)."""
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras", minversion="3")
    if keras.backend.backend() != "jax":
        pytest.skip(f"keras runs on {keras.backend.backend()} here, not jax")
    return keras


def test_keras_layer_paths():
    """Issue 35 item 8: a Keras 3 model trained through ``stateless_call``
    had no layer named (phase "loss", path None); now the layers called are
    named as Keras names them, joined with "/". The classes are restored."""
    keras = _keras()
    keras.utils.set_random_seed(0)
    block = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, name="d")], name="block"
    )
    model = keras.Sequential(
        [keras.Input((4,)), block, keras.layers.Dense(1, name="out")], name="net"
    )
    block.layers[0].kernel.assign(np.full((4, 8), 1e30, np.float32))

    def loss_fn(params, x):
        pred, _ = model.stateless_call(params, [], x)
        return jnp.mean(pred**2)

    params = [v.value for v in model.trainable_variables]
    step = train.make_train_step(loss_fn)
    state = train.TrainState.create(params=params, optimizer=optax.sgd(0.1))
    call = keras.Layer.__call__
    loc = _locate(step, state, jnp.full((2, 4), 1e10))  # 4e40: float32 overflow
    assert (loc.phase, loc.path, loc.op) == ("forward", "block/d", "matmul")
    assert keras.Layer.__call__ is call


def test_step_without_loss_fn_is_refused():
    with pytest.raises(TypeError, match="made by make_train_step"):
        diagnostics.locate(lambda s, b: (s, {}), None, None)


def _hlo(step, state, batch):
    """StableHLO and the compiled HLO of the jitted step, without the source
    locations (they name the test's own call lines, not the computation);
    op names, which carry the name scopes, are kept."""
    lowered = step.lower(state, batch)
    compiled = lowered.compile().as_text().split("\n\nFileNames")[0]
    where = r" (source_file|source_line|source_end_line|source_column|"
    where += r"source_end_column|stack_frame_id)=[^ }]+"
    return lowered.as_text(), re.sub(where, "", compiled)


def test_hot_path_hlo_unchanged_and_classes_restored():
    step, state = _net_step()
    before = _hlo(step, state, _xy())
    call = nnx.Linear.__call__
    assert diagnostics.locate(step, state, _xy()) is not None
    assert nnx.Linear.__call__ is call
    assert _hlo(step, state, _xy()) == before
    fresh, _ = _net_step()  # traced after locate ran
    assert _hlo(fresh, state, _xy()) == before
    # locate's module scopes never reach a step traced outside it.
    debug = fresh.lower(state, _xy()).as_text(debug_info=True)
    assert "layers" in debug and locate_scopes.MARK not in debug


def test_memory_bounded_by_live_values():
    # 100 chained adds on a 4 MB array: keeping every value would hold 400 MB;
    # the interpreter drops each after its last use (add's gradient keeps no
    # residuals, so a handful of arrays are alive at any time). finite=False:
    # run op by op although the compiled step is finite.
    def loss_fn(p, b):
        x = p["w"] * b
        for _ in range(100):
            x = x + 1.0
        return jnp.sum(x)

    n = 1 << 20
    step = train.make_train_step(loss_fn)
    state = train.TrainState.create(params={"w": jnp.ones(n)}, optimizer=optax.sgd(1))
    assert diagnostics.locate(step, state, jnp.ones(n), finite=False) is None
    one = 4 * n
    assert one * 2 <= locate_trace.stats["peak_live_bytes"] <= 4 * one


def test_fit_stop_puts_location_in_error_and_record(tmp_path):
    step, state = _net_step()
    log = tmp_path / "log.jsonl"
    with pytest.raises(train.NonFiniteError) as err:
        train.fit(
            state,
            step,
            [_xy()],
            nan_policy=train.NanPolicy.stop(max_consecutive=1),
            log=train.Log(log, progress=False),
        )
    loc = err.value.location
    assert (loc.phase, loc.path) == ("forward", "layers.2")
    assert "where (diagnostics.locate):" in str(err.value)
    rec = json.loads(log.read_text().splitlines()[-1])
    assert rec["location"]["phase"] == "forward"
    assert rec["location"]["path"] == "layers.2"


def test_fit_skip_locates_the_first_n_non_finite_steps():
    step, state = _net_step()
    batches = [_xy(), _xy(jnp.zeros((4, 8))), _xy(), _xy()]
    _, hist = train.fit(
        state, step, batches, log=None, nan_policy=train.NanPolicy.skip(locate_first=2)
    )
    assert [h["finite"] for h in hist] == [False, True, False, False]
    assert [h.get("location", {}).get("path") for h in hist] == [
        "layers.2",
        None,
        "layers.2",
        None,
    ]
    assert "location" not in hist[3]
    _, hist = train.fit(
        state,
        step,
        batches[:1],
        log=None,
        nan_policy=train.NanPolicy.skip(locate_first=0),
    )
    assert "location" not in hist[0]
    with pytest.raises(ValueError, match="locate_first must be an int >= 0"):
        train.fit(
            state,
            step,
            batches,
            log=None,
            nan_policy=train.NanPolicy.skip(locate_first=-1),
        )


def test_format_location_of_a_real_case():
    loc = _locate(*_adam_case(1e-4))
    text = diagnostics.format_location(loc)
    assert (
        text.splitlines()[0] == "non-finite value first in phase 'update' at w, op div"
    )


def test_module_paths_inside_a_jitted_forward_traced_by_the_hot_path_first():
    graphdef, params = nnx.split(Net())

    @jax.jit
    def forward(p, x):
        return nnx.merge(graphdef, p)(x)

    def loss_fn(p, b):
        return jnp.mean((forward(p, b["x"]).astype(jnp.float32) - b["y"]) ** 2)

    step = train.make_train_step(loss_fn, policy=FP16)
    state = train.TrainState.create(params=params, optimizer=optax.sgd(0.1))
    step(state, _xy())  # `forward` is now in jax's trace cache, without scopes
    loc = _locate(step, state, _xy())
    assert (loc.phase, loc.path, loc.op) == ("forward", "layers.2", "matmul")


def test_a_step_xla_computed_finite_gives_none():
    # sqrt(sum(h * mask)) on a fully masked row: eagerly the gradient is
    # mask * 1/(2 sqrt(0)) = 0 * inf = NaN, but XLA turns x * convert(bool)
    # into a select and the compiled step is finite (applied): locate
    # answers about the step that ran.
    def loss_fn(p, b):
        return jnp.sum(jnp.sqrt(jnp.sum(p["w"] * b["x"] * b["mask"], axis=-1)))

    step = train.make_train_step(loss_fn)
    state = train.TrainState.create(
        params={"w": jnp.ones((2, 3))}, optimizer=optax.sgd(1)
    )
    batch = {"x": jnp.ones((2, 3)), "mask": jnp.array([[True] * 3, [False] * 3])}
    assert _locate(step, state, batch) is None
    # The eager re-run itself, when asked for (finite=False: the step was
    # not applied), still finds the NaN XLA avoided.
    loc = diagnostics.locate(step, state, batch, finite=False)
    assert (loc.phase, loc.path, loc.op) == ("backward", "w", "div")


def test_while_loop_names_the_op_in_its_body():
    def grow(c):
        return c[0] + 1, c[1] * 1e10  # 1e40 > float32's 3.4e38 at i = 4

    def loss_fn(p, b):
        _, y = jax.lax.while_loop(lambda c: c[0] < 5, grow, (0, b))
        return jnp.sum(p["w"] * y)

    step = train.make_train_step(loss_fn)
    state = train.TrainState.create(params={"w": jnp.ones(3)}, optimizer=optax.sgd(1))
    loc = _locate(step, state, jnp.ones(3))
    assert (loc.phase, loc.path, loc.op) == ("loss", None, "mul")
    assert loc.source.endswith("in grow")
    assert loc.detail.startswith("float32 overflow: max |x| = 1e+40 > 3.40282e+38")


def test_bare_array_params_are_named_params():
    step = train.make_train_step(lambda p, b: jnp.sqrt(jnp.sum((p - b) ** 2)))
    state = train.TrainState.create(params=jnp.ones(3), optimizer=optax.sgd(1))
    loc = _locate(step, state, jnp.ones(3))
    assert (loc.phase, loc.path) == ("backward", "params")
    assert diagnostics.format_location(loc).startswith(
        "non-finite value first in phase 'backward' at params, op div"
    )
    bad = train.TrainState.create(params=jnp.full(3, jnp.nan), optimizer=optax.sgd(1))
    assert diagnostics.locate(step, bad, jnp.ones(3)).path == "params"


class Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


class Remat(nnx.Module):
    def __init__(self):
        self.block = Block(nnx.Rngs(0))
        self.block.fc.kernel[...] = jnp.full((8, 8), 1e4)  # 8e4 > 65504

    def __call__(self, x):
        return nnx.remat(lambda block, x: block(x))(self.block, x)


class Scan(nnx.Module):
    def __init__(self):
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key):
            return Block(nnx.Rngs(key))

        self.blocks = make(jax.random.split(jax.random.key(0), 3))
        self.blocks.fc.kernel[...] = jnp.full((3, 8, 8), 20.0)  # 2.56e4 * 160

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


@pytest.mark.parametrize(
    ("model", "path"), [(Remat, "block.fc"), (Scan, "blocks.fc")], ids=["remat", "scan"]
)
def test_modules_inside_nnx_remat_and_scan_are_named(model, path):
    graphdef, params = nnx.split(model())

    def loss_fn(p, b):
        return jnp.mean(nnx.merge(graphdef, p)(b).astype(jnp.float32) ** 2)

    step = train.make_train_step(loss_fn, policy=FP16)
    state = train.TrainState.create(params=params, optimizer=optax.sgd(0.1))
    loc = _locate(step, state, jnp.ones((2, 8)))
    assert (loc.phase, loc.path, loc.op) == ("forward", path, "matmul")


def test_update_outputs_are_not_held():
    # Adam over 8 leaves of 64 kB. optax computes each stage for the whole
    # tree, so the new moments of every leaf are alive together (16 leaves)
    # as in the compiled step; each output is checked when computed and not
    # held after its last use (holding them would add 24 leaves).
    params = {f"w{i}": jnp.ones(1 << 14) for i in range(8)}
    step = train.make_train_step(lambda p, b: sum(jnp.sum(w * b) for w in p.values()))
    state = train.TrainState.create(params=params, optimizer=optax.adam(1e-3))
    assert diagnostics.locate(step, state, jnp.ones(1 << 14), finite=False) is None
    leaf = 4 << 14
    grads_run, update_run = locate_trace.stats["peaks"]
    assert grads_run <= 11 * leaf  # the 8 gradients it keeps, 2 in flight
    assert update_run <= 20 * leaf, update_run / leaf


def test_a_minus_inf_mask_in_the_model_state_is_no_params_failure():
    # A causal mask of -inf kept in the model state, and a real overflow.
    def loss_fn(p, ms, b):
        s = (b @ p["w"]) + ms["mask"]
        return jnp.mean(jax.nn.softmax(s.astype(jnp.float32), -1)), ms

    mask = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), 0.0, -jnp.inf)
    step = train.make_train_step(loss_fn, has_state=True, policy=FP16)
    state = train.TrainState.create(
        params={"w": jnp.full((4, 4), 1e4)},
        optimizer=optax.sgd(0.1),
        model_state={"mask": mask},
    )
    loc = _locate(step, state, jnp.full((4, 4), 2.0))
    assert (loc.phase, loc.op) == ("loss", "matmul")
    assert loc.detail.startswith("float16 overflow: max |x| = 8e+04")
