"""Both `fit`s write the same records: history and JSONL, aux scalars included."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import optax
import torch

from jaxstable import train as jtrain
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
    keys |= {"aux['max_err']"}  # scalar aux leaves only; the vector is left out
    assert [set(r) for r in jhist] == [keys] * 3
    assert [set(r) for r in thist] == [keys] * 3
    for name in ("jax", "torch"):
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert [set(json.loads(line)) for line in lines] == [keys] * 3
