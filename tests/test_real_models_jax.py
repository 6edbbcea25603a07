"""The models users train, in Flax NNX: real model code, random weights, tiny sizes.

A GPT-2-shaped transformer built from ``nnx.Embed``, ``nnx.MultiHeadAttention``,
``nnx.LayerNorm`` and ``nnx.Linear``, and a ResNet-18-shaped network of
``nnx.Conv`` and ``nnx.BatchNorm`` (torchvision's module names), each built
as a user should for mixed precision, ``dtype`` (compute) and
``param_dtype=float32`` on every module, and trained through
`jaxstable.train.make_train_step` with a bfloat16 policy, `TrainState.from_nnx`
and `nnx_loss`. For each: the loss falls; a batch with a NaN in its float
data is skipped with the parameters, the optimizer state and the batch
statistics bitwise unchanged and the loss scale backed off; a run resumed
from a checkpoint equals the uninterrupted one bit for bit; `locate` names
where a real float16 overflow starts by the model's own module path. The
transformer's matmuls are checked to run in bfloat16 (issue 35: an
``nnx.Embed`` left at float32 silently puts them all back in float32).

The mirror of `tests/test_real_models_torch.py`.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxstable import diagnostics, losses, train, transforms

VOCAB, BATCH, SEQ = 64, 4, 16
TRAIN_STEPS, AFTER = 4, 2  # steps before the checkpoint; steps after the bad one
POLICY = {
    jnp.bfloat16: "params=float32,compute=bfloat16,output=float32",
    jnp.float16: "params=float32,compute=float16,output=float32",
}


# The models' own initialisations, none a truncated normal (flax's default
# truncated normal compiles a program per shape: 15 s of CPU for the 21
# kernels here): GPT-2's normal(0.02) for every weight and embedding, and
# torchvision's ResNet kaiming_normal_(mode="fan_out", nonlinearity="relu");
# torch.nn.Linear's default (kaiming_uniform_(a=sqrt(5))) for the fc.
GPT2_INIT = dict(kernel_init=nnx.initializers.normal(0.02))
GPT2_EMBED_INIT = dict(embedding_init=nnx.initializers.normal(0.02))
CONV_INIT = dict(
    kernel_init=nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
)
FC_INIT = dict(
    kernel_init=nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
)


def rngs(seed: int) -> nnx.Rngs:
    """Parameter and dropout streams on "rbg" keys: a threefry program takes
    0.6 s of CPU to compile here, one per parameter shape (15 s for the
    ResNet's 21 kernels), an rbg one 0.2 s."""
    key = lambda s: jax.random.key(s, impl="rbg")  # noqa: E731
    return nnx.Rngs(params=key(seed), dropout=key(seed + 1))


class MLP(nnx.Module):
    def __init__(self, d: int, *, kw: dict):
        self.c_fc = nnx.Linear(d, 4 * d, **GPT2_INIT, **kw)
        self.c_proj = nnx.Linear(4 * d, d, **GPT2_INIT, **kw)

    def __call__(self, x):
        return self.c_proj(nnx.gelu(self.c_fc(x)))  # GPT-2's tanh GELU


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, *, kw: dict):
        self.ln_1 = nnx.LayerNorm(d, **kw)
        # GPT-2's attention dropout (0.1); it also takes flax's einsum path,
        # which runs in float16 on CPU (jax.nn.dot_product_attention's
        # float16 x float16 -> float32 dot does not).
        self.attn = nnx.MultiHeadAttention(
            heads, d, dropout_rate=0.1, decode=False, **GPT2_INIT, **kw
        )
        self.ln_2 = nnx.LayerNorm(d, **kw)
        self.mlp = MLP(d, kw=kw)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nnx.Module):
    """GPT-2's layout (``wte``, ``wpe``, ``h.N``, ``ln_f``), 2 layers of width 32."""

    def __init__(self, dtype, seed: int, d: int = 32, heads: int = 2, layers: int = 2):
        # dtype on every module, the Embed included: an Embed left at its
        # default keeps float32 and the whole residual stream follows it.
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs(seed))
        self.wte = nnx.Embed(VOCAB, d, **GPT2_EMBED_INIT, **kw)
        self.wpe = nnx.Embed(SEQ, d, **GPT2_EMBED_INIT, **kw)
        self.drop = nnx.Dropout(0.1, rngs=kw["rngs"])
        self.h = nnx.List([Block(d, heads, kw=kw) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, **kw)
        self.lm_head = nnx.Linear(d, VOCAB, use_bias=False, **GPT2_INIT, **kw)

    def __call__(self, ids):
        x = self.drop(self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))[None])
        mask = nnx.make_causal_mask(ids)
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


class BasicBlock(nnx.Module):
    """torchvision's ResNet BasicBlock in NHWC, same names."""

    def __init__(self, cin: int, cout: int, stride: int, *, kw: dict):
        def conv(i, o, k, s):
            p = (k - 1) // 2
            pads = ((p, p), (p, p))
            return nnx.Conv(i, o, (k, k), (s, s), padding=pads, **CONV_INIT, **kw)

        def bn():
            return nnx.BatchNorm(cout, momentum=0.9, **kw)

        self.conv1, self.bn1 = conv(cin, cout, 3, stride), bn()
        self.conv2, self.bn2 = conv(cout, cout, 3, 1), bn()
        self.downsample = nnx.data(None)
        if stride != 1 or cin != cout:
            self.downsample = nnx.List([conv(cin, cout, 1, stride), bn()])

    def __call__(self, x):
        skip = x
        if self.downsample is not None:
            skip = self.downsample[1](self.downsample[0](x))
        x = nnx.relu(self.bn1(self.conv1(x)))
        return nnx.relu(self.bn2(self.conv2(x)) + skip)


class ResNet18(nnx.Module):
    """torchvision's resnet18 layout (``layer3.1.conv2`` is that module there
    too), widths divided by 16; torch's BatchNorm2d momentum (flax 0.9)."""

    def __init__(self, dtype, seed: int, width: int = 4, num_classes: int = 10):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs(seed))
        pads = ((3, 3), (3, 3))
        self.conv1 = nnx.Conv(3, width, (7, 7), (2, 2), padding=pads, **CONV_INIT, **kw)
        self.bn1 = nnx.BatchNorm(width, momentum=0.9, **kw)
        chans = [width * 2**i for i in range(4)]
        for i, (cin, cout) in enumerate(zip([width, *chans[:-1]], chans, strict=True)):
            stride = 1 if i == 0 else 2
            blocks = [
                BasicBlock(cin, cout, stride, kw=kw),
                BasicBlock(cout, cout, 1, kw=kw),
            ]
            setattr(self, f"layer{i + 1}", nnx.List(blocks))
        self.fc = nnx.Linear(chans[-1], num_classes, **FC_INIT, **kw)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        for i in range(4):
            for block in getattr(self, f"layer{i + 1}"):
                x = block(x)
        return self.fc(jnp.mean(x, axis=(1, 2)))


def lm_loss(model, batch):
    """Next-token cross-entropy, weighted per token (as prompt masking in
    fine-tuning): the float `weights` carry the bad value of a bad batch."""
    logits = model(batch["ids"])[:, :-1]
    per_token = losses.softmax_cross_entropy(
        logits, batch["ids"][:, 1:], reduction="none"
    )
    w = batch["weights"][:, 1:]
    return jnp.sum(per_token * w) / jnp.sum(w)


def image_loss(model, batch):
    return losses.softmax_cross_entropy(model(batch["images"]), batch["labels"])


def lm_batch(bad: bool = False) -> dict:
    rng = np.random.default_rng(1)
    weights = np.ones((BATCH, SEQ), np.float32)
    if bad:
        weights[1, 3] = np.nan  # a corrupted weight in the data
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    return {"ids": jnp.asarray(ids), "weights": jnp.asarray(weights)}


def image_batch(bad: bool = False) -> dict:
    rng = np.random.default_rng(1)
    images = rng.standard_normal((8, 32, 32, 3)).astype(np.float32)
    if bad:
        images[2, 5, 7, 0] = np.nan  # one corrupted pixel
    labels = rng.integers(0, 10, (8,)).astype(np.int32)
    return {"images": jnp.asarray(images), "labels": jnp.asarray(labels)}


def lm_optimizer():
    return transforms.stable_optimizer(optax.adamw(1e-2), max_grad_norm=1.0)


def image_optimizer():
    return transforms.stable_optimizer(optax.sgd(0.1, momentum=0.9))


# model, loss, batch, optimizer: each model's usual recipe (AdamW with
# clipping for the language model, SGD with momentum for the ResNet); no
# loss scale, as bfloat16 needs none (float16's GradScaler recipe is tested
# in jaxstable/tests and parity_tests).
MODELS = {
    "gpt": (GPT, lm_loss, lm_batch, lm_optimizer),
    "resnet18": (ResNet18, image_loss, image_batch, image_optimizer),
}


class Run:
    """One model's step and optimizer, built once; `state(seed)` builds a
    fresh state of the same structure (the same ``tx``, so the same
    compiled step)."""

    def __init__(self, name: str, dtype=jnp.bfloat16, jit: bool = True):
        self.build, loss, self.batch, optimizer = MODELS[name]
        self.dtype = dtype
        self.model = self.build(dtype, seed=0)
        self.model.train()
        self.tx = optimizer()
        self.step = train.make_train_step(
            train.nnx_loss(self.model, loss),
            has_state=True,
            policy=POLICY[dtype],
            jit=jit,
        )

    def state(self, seed: int = 0) -> train.TrainState:
        model = self.model if seed == 0 else self.build(self.dtype, seed=seed)
        return train.TrainState.from_nnx(model, self.tx)


def _run(name: str, tmp_path_factory) -> dict:
    """A run: TRAIN_STEPS steps, a checkpoint, a bad batch, AFTER steps."""
    r = Run(name)
    state = r.state()
    losses_ = []
    for _ in range(TRAIN_STEPS):
        state, m = r.step(state, r.batch())
        losses_.append(float(m["loss"]))
    path = tmp_path_factory.mktemp(name) / "ckpt"
    train.save_checkpoint(path, state)
    before = state
    state, bad = r.step(state, r.batch(bad=True))
    after_bad = state
    for _ in range(AFTER):
        state, m = r.step(state, r.batch())
        assert bool(m["finite"])
    return dict(
        run=r,
        losses=losses_,
        path=path,
        before=before,
        bad=bad,
        after_bad=after_bad,
        end=state,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _run(name, tmp_path_factory)
        return cache[name]

    return get


@pytest.fixture(params=sorted(MODELS))
def run(request, runs):
    return runs(request.param)


def test_trains_in_bfloat16(run):
    assert np.all(np.isfinite(run["losses"]))
    assert run["losses"][-1] < run["losses"][0]


def test_bad_batch_is_skipped_bitwise(run):
    m, before, after = run["bad"], run["before"], run["after_bad"]
    assert (bool(m["finite"]), bool(m["grads_finite"])) == (False, False)
    assert int(after.skipped_total) == int(before.skipped_total) + 1 == 1
    # parameters, optimizer state (inside the skip's counters), batch
    # statistics and loss scale exactly as before the step
    chex.assert_trees_all_equal(
        (after.params, after.opt_state.inner_state, after.loss_scale),
        (before.params, before.opt_state.inner_state, before.loss_scale),
    )
    stats = lambda s: nnx.filter_state(s.model_state, nnx.BatchStat)  # noqa: E731
    chex.assert_trees_all_equal(stats(after), stats(before))
    assert int(after.opt_state.skipped_total) == 1


def test_resume_is_exact(run):
    r = run["run"]
    state = train.load_checkpoint(run["path"], r.state(seed=1))  # other weights
    chex.assert_trees_all_equal(state, run["before"])
    state, m = r.step(state, r.batch(bad=True))
    assert not bool(m["finite"])
    for _ in range(AFTER):
        state, _ = r.step(state, r.batch())
    chex.assert_trees_all_equal(state, run["end"])


def test_transformer_matmuls_run_in_bfloat16(runs):
    # All 51 dot_generals of the step. The same GPT built with dtype=None
    # (flax's default) runs all 51 in float32 under this policy: its Embeds
    # keep float32 and the residual stream follows (issue 35, item 1).
    gpt = runs("gpt")
    r = gpt["run"]
    text = r.step.lower(gpt["before"], r.batch()).as_text()
    dots = re.findall(r"stablehlo\.dot_general .*", text)
    operands = re.compile(r": \(tensor<[0-9x]*x(\w+)>, tensor<[0-9x]*x(\w+)>\)")
    dtypes = [operands.search(d).groups() for d in dots]
    assert len(dots) > 30 and set(dtypes) == {("bf16", "bf16")}, set(dtypes)


# Weights grown to a size float16 cannot carry (nothing else changed): where
# the first non-finite value appears, by the model's own module paths. The
# float16 steps are not jitted: locate then re-runs them op by op, reusing
# the one-op programs of its own replay (GPT: 12 s of CPU here, 26 s with a
# jitted float16 step compiled first).
def test_locate_gpt_gelu_backward_overflow():
    r = Run("gpt", jnp.float16, jit=False)
    state = r.state()
    kernel = state.params["h"][1]["mlp"]["c_fc"]["kernel"]
    kernel[...] = kernel[...] * 1000.0
    loc = diagnostics.locate(r.step, state, lm_batch())
    # flax's tanh GELU computes x**3: inf above |x| = 40 in float16, which
    # its tanh hides in the forward; the backward multiplies 0 by 3 x**2,
    # inf above |x| = 148, and every gradient before the block is NaN.
    assert (loc.phase, loc.op) == ("backward", "pow")
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state.params)}
    assert loc.path in names
    assert "in the output of pow in h.1.mlp" in loc.detail


def test_locate_resnet_forward_overflow():
    r = Run("resnet18", jnp.float16, jit=False)
    state = r.state()
    kernel = state.params["layer3"][1]["conv2"]["kernel"]
    kernel[...] = kernel[...] * 5e4  # its largest weight still fits float16
    loc = diagnostics.locate(r.step, state, image_batch())
    assert (loc.phase, loc.path, loc.op) == ("forward", "layer3.1.conv2", "conv")
    assert loc.detail.startswith("float16 overflow")
