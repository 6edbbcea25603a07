"""locate gives the same answer in both frameworks: for each phase, the same
small model in Flax NNX and torch.nn (same module names, same weights), a
step that goes non-finite for a real numerical reason, and the same phase,
path, op and cause text from `jaxstable.diagnostics.locate` and
`torchref.diagnostics.locate`. Plus the seeds: DBNet's step function
(seeds/002) and the segmentation U-Net in float16 (seeds/000)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from examples.segmentation import convert, model_jax, model_torch
from jaxstable import diagnostics as jd
from jaxstable import loss_scale as jls
from jaxstable import losses as jl
from jaxstable import train as jt
from torchref import diagnostics as td
from torchref import loss_scale as tls
from torchref import losses as tl
from torchref import train as tt

FP16 = "params=float32,compute=float16,output=float32"
SCALES = (2.0, 20.0, 10.0)  # activations 16 -> 2560 -> 204800 (> 65504)


# ----------------------------------------------------------------- models
class JaxNet(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in SCALES])
        for layer, v in zip(self.layers, SCALES, strict=True):
            layer.kernel[...] = jnp.full((8, 8), v)

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in SCALES)
        with torch.no_grad():
            for layer, v in zip(self.layers, SCALES, strict=True):
                layer.weight.fill_(v)
                layer.bias.zero_()

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class TorchParams(torch.nn.Module):
    def __init__(self, **tensors):
        super().__init__()
        for k, v in tensors.items():
            setattr(self, k, torch.nn.Parameter(torch.as_tensor(v)))


def _jax_net(x, policy):
    graphdef, params = nnx.split(JaxNet())

    def loss_fn(p, b):
        out = nnx.merge(graphdef, p)(b["x"])
        return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)

    step = jt.make_train_step(loss_fn, policy=policy)
    state = jt.TrainState.create(params=params, optimizer=optax.sgd(0.1))
    return jd.locate(step, state, {"x": jnp.asarray(x), "y": jnp.zeros((4, 8))})


def _torch_net(x, autocast):
    model = TorchNet()

    def loss_fn(m, b):
        return ((m(b["x"]).float() - b["y"]) ** 2).mean()

    step = tt.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn,
        autocast_dtype=autocast,
    )
    return td.locate(step, {"x": torch.tensor(x), "y": torch.zeros(4, 8)})


# ------------------------------------------------------------------ cases
def case_input():
    x = np.ones((4, 8), np.float32)
    x[1, 2] = np.nan  # a corrupt sample, as a loader would hand it over
    return _jax_net(x, None), _torch_net(x, None)


def case_forward():
    x = np.ones((4, 8), np.float32)
    return _jax_net(x, FP16), _torch_net(x, torch.float16)


def case_loss():
    w = np.array([[200.0, -200.0]], np.float32)  # a confident wrong class

    def jloss(p, b):
        probs = jax.nn.softmax(b["x"] @ p["w"], axis=-1)
        return -jnp.mean(jnp.log(jnp.take_along_axis(probs, b["y"], -1)))

    step = jt.make_train_step(jloss)
    state = jt.TrainState.create(params={"w": jnp.asarray(w)}, optimizer=optax.sgd(1))
    jloc = jd.locate(
        step, state, {"x": jnp.ones((3, 1)), "y": jnp.ones((3, 1), jnp.int32)}
    )

    def tloss(m, b):
        probs = torch.softmax(b["x"] @ m.w, dim=-1)
        return -torch.log(probs.gather(-1, b["y"])).mean()

    model = TorchParams(w=w)
    tstep = tt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1.0), tloss)
    tloc = td.locate(
        tstep, {"x": torch.ones(3, 1), "y": torch.ones(3, 1, dtype=torch.long)}
    )
    return jloc, tloc


def case_backward_sqrt():
    # The Euclidean distance at distance 0: sqrt(0) = 0, its derivative 1/0.
    step = jt.make_train_step(lambda p, b: jnp.sqrt(jnp.sum((p["w"] - b) ** 2)))
    state = jt.TrainState.create(params={"w": jnp.ones(3)}, optimizer=optax.sgd(1))
    jloc = jd.locate(step, state, jnp.ones(3))
    model = TorchParams(w=torch.ones(3))
    tstep = tt.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        lambda m, b: torch.sqrt(((m.w - b) ** 2).sum()),
    )
    return jloc, td.locate(tstep, torch.ones(3))


def jax_db_reference_step(x, y, k=50.0):
    """The DBNet references' step function (seeds/002), JAX."""
    return 1.0 / (1.0 + jnp.exp(-k * (x - y)))


def torch_db_reference_step(x, y, k=50.0):
    """The DBNet references' step function (seeds/002), torch."""
    return torch.reciprocal(1.0 + torch.exp(-k * (x - y)))


def case_backward_dbnet():
    # Probability and threshold maps in [0, 1], float16: exp(50) is inf,
    # 1 / (1 + inf) = 0 keeps the loss finite, its gradient is 0 * inf.
    g = np.linspace(0.0, 1.0, 11, dtype=np.float32)
    xs, ys = np.meshgrid(g, g)

    def jloss(p, b):
        x, y = p["x"].astype(jnp.float16), b.astype(jnp.float16)
        return jnp.mean(jax_db_reference_step(x, y)).astype(jnp.float32)

    step = jt.make_train_step(jloss)
    state = jt.TrainState.create(params={"x": jnp.asarray(xs)}, optimizer=optax.sgd(1))
    jloc = jd.locate(step, state, jnp.asarray(ys))
    model = TorchParams(x=xs)
    tstep = tt.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        lambda m, b: torch_db_reference_step(m.x.half(), b.half()).float().mean(),
    )
    return jloc, td.locate(tstep, torch.tensor(ys))


def case_loss_scale():
    # dL/dout = 1 per element; times 2**24 it passes float16's 65504 when
    # the cotangent is cast back to the float16 matmul; at scale 1 it is 1.
    w = np.ones((4, 2), np.float32)

    def jloss(p, b):
        return jnp.mean(((b[0] @ p["w"]).astype(jnp.float32) - b[1]) ** 2)

    step = jt.make_train_step(jloss, policy=FP16)
    state = jt.TrainState.create(
        params={"w": jnp.asarray(w)},
        optimizer=optax.sgd(0.1),
        loss_scale=jls.StaticLossScale(2.0**24),
    )
    jloc = jd.locate(step, state, (jnp.ones((4, 4)), jnp.zeros((4, 2))))
    model = TorchParams(w=w)
    tstep = tt.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: (((b[0] @ m.w).float() - b[1]) ** 2).mean(),
        autocast_dtype=torch.float16,
        scaler=tls.StaticLossScale(2.0**24),
    )
    return jloc, td.locate(tstep, (torch.ones(4, 4), torch.zeros(4, 2)))


def case_update_adam_fp16():
    # Pure float16 training with Adam: g = 1e-4, g**2 = 1e-8 underflows to 0
    # and so does eps = 1e-8: m / (sqrt(0) + 0) is inf.
    step = jt.make_train_step(lambda p, b: jnp.sum(p["w"] * b).astype(jnp.float32))
    state = jt.TrainState.create(
        params={"w": jnp.ones(3, jnp.float16)}, optimizer=optax.adam(1e-3)
    )
    jloc = jd.locate(step, state, jnp.full(3, 1e-4, jnp.float16))
    model = TorchParams(w=torch.ones(3, dtype=torch.float16))
    tstep = tt.TrainStep(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        lambda m, b: (m.w * b).sum().float(),
    )
    return jloc, td.locate(tstep, torch.full((3,), 1e-4, dtype=torch.float16))


# phase, path, op (None: the frameworks' ops differ by design, see below)
EXPECTED = {
    case_input: ("input", "x", None),
    case_forward: ("forward", "layers.2", "matmul"),
    case_loss: ("loss", None, "log"),
    case_backward_sqrt: ("backward", "w", "div"),
    case_backward_dbnet: ("backward", "x", "exp"),
    case_loss_scale: ("loss_scale", "w", "cast"),
    # optax divides (div), torch.optim.Adam fuses it into addcdiv_.
    case_update_adam_fp16: ("update", "w", ...),
}


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: c.__name__)
def test_same_phase_path_op_and_cause(case):
    jloc, tloc = case()
    phase, path, op = EXPECTED[case]
    assert (jloc.phase, jloc.path) == (tloc.phase, tloc.path) == (phase, path)
    if op is not ...:
        assert jloc.op == tloc.op == op
    assert jloc.detail == tloc.detail
    assert (jloc.dtype, jloc.shape) == (tloc.dtype, tloc.shape)
    assert (jloc.nan_count, jloc.inf_count) == (tloc.nan_count, tloc.inf_count)
    for loc in (jloc, tloc):
        assert jd.format_location(loc) == td.format_location(loc)


def test_finite_steps_give_none_in_both():
    x = np.ones((4, 8), np.float32)  # float32 holds 204800 and its gradients
    assert _jax_net(x, None) is None
    assert _torch_net(x, None) is None


def test_seed002_dbnet_names_the_step_function():
    jloc, tloc = case_backward_dbnet()
    assert "in jax_db_reference_step" in jloc.source
    assert "in torch_db_reference_step" in tloc.source
    # the same line of each step function: the exp
    assert jloc.source.split(":")[0] == tloc.source.split(":")[0]
    assert jloc.source.split(":")[1] != tloc.source.split(":")[1]


def test_seed000_segmentation_fp16_names_its_layer():
    # seeds/000: a U-Net whose logits grew large during AMP training (the
    # head's weights ~1e4, unconstrained by ignored pixels). In float16 the
    # head's convolution overflows, every layer before it is finite.
    torch.manual_seed(0)
    tmodel = model_torch.UNet(in_channels=3, num_classes=4, width=4, depth=1)
    with torch.no_grad():
        tmodel.head.weight.mul_(1e5)
    jmodel = convert.nnx_from_torch(tmodel)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 4, size=(2, 8, 8))

    graphdef, params, stats = model_jax.split(jmodel)

    def jloss(p, s, b):
        logits, s = model_jax.apply(graphdef, p, s, b[0], train=True)
        return jl.softmax_cross_entropy(logits, b[1]), s

    step = jt.make_train_step(jloss, has_state=True, policy=FP16)
    state = jt.TrainState.create(
        params=params,
        optimizer=optax.sgd(0.1),
        model_state=stats,
        loss_scale=jls.DynamicLossScale(),
    )
    jloc = jd.locate(step, state, (jnp.asarray(images), jnp.asarray(labels)))

    def tloss(m, b):
        return tl.softmax_cross_entropy(m(b[0]), b[1])

    tstep = tt.TrainStep(
        tmodel.train(),
        torch.optim.SGD(tmodel.parameters(), lr=0.1),
        tloss,
        autocast_dtype=torch.float16,
        scaler=tls.DynamicLossScale(),
    )
    batch = (torch.tensor(images).permute(0, 3, 1, 2), torch.tensor(labels))
    tloc = td.locate(tstep, batch)
    for loc in (jloc, tloc):
        assert (loc.phase, loc.path, loc.op) == ("forward", "head", "conv")
        assert loc.detail.startswith("float16 overflow: max |x| = ")
        assert loc.detail.endswith("> 65504 in the output of conv in head")


def test_fit_stop_records_the_same_location(tmp_path):
    graphdef, params = nnx.split(JaxNet())

    def jloss(p, b):
        out = nnx.merge(graphdef, p)(b["x"])
        return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)

    jstep = jt.make_train_step(jloss, policy=FP16)
    jstate = jt.TrainState.create(
        params=params, optimizer=optax.sgd(0.1), loss_scale=jls.DynamicLossScale()
    )
    model = TorchNet()
    tstep = tt.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: ((m(b["x"]).float() - b["y"]) ** 2).mean(),
        autocast_dtype=torch.float16,
        scaler=tls.DynamicLossScale(),
    )
    kw = dict(nan_policy="stop", max_consecutive_nonfinite=1, progress=False)
    with pytest.raises(jt.NonFiniteError) as jerr:
        jt.fit(
            jstate,
            jstep,
            [{"x": jnp.ones((4, 8)), "y": jnp.zeros((4, 8))}],
            log_path=tmp_path / "j.jsonl",
            **kw,
        )
    with pytest.raises(tt.NonFiniteError) as terr:
        tt.fit(
            tstep,
            [{"x": torch.ones(4, 8), "y": torch.zeros(4, 8)}],
            log_path=tmp_path / "t.jsonl",
            **kw,
        )
    jloc, tloc = jerr.value.location, terr.value.location
    assert (jloc.phase, jloc.path, jloc.op) == (tloc.phase, tloc.path, tloc.op)
    assert jloc.detail == tloc.detail
    assert (jloc.phase, jloc.path) == ("forward", "layers.2")
    jrec = json.loads((tmp_path / "j.jsonl").read_text().splitlines()[-1])
    trec = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[-1])
    assert list(jrec) == list(trec) and list(jrec["location"]) == list(trec["location"])
    for key in ("phase", "path", "op", "detail", "shape", "dtype"):
        assert jrec["location"][key] == trec["location"][key]
