"""`diagnostics.locate` across processes without gathering (issue 36, item 4).

Two processes with two forced CPU devices each (gloo, the coordinator on
127.0.0.1) hold an NNX MLP with FSDP on a global mesh of 4 devices (every
weight split over the 4) and each loads only its own rows of the batch
(``shard_batch(..., process_local=True)``). Each process calls `locate` on
the sharded state and batch; every answer must name the layer, the op and
the process and device whose rows made the first non-finite value, the
same on both processes, while `jax.experimental.multihost_utils`'
``process_allgather`` (the only way a value crosses processes here) never
carries more than a few numbers per device, and the eager op-by-op path
(which needs global values) is never entered. The counting program's
memory per device (XLA's memory analysis) is compared with the step's.

The launch, bounded timeouts and cleanup are `test_multiprocess`'s.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from jaxstable.tests.test_multiprocess import _free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

ROWS = 8  # global batch: 2 rows per device; process 1 holds rows 4..7
TIMEOUT_S = 120
WIDE = 256  # the MLP whose memory is compared


def _batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = np.zeros((ROWS, 3), np.float32)
    overflow = x.copy()
    overflow[6] = 40.0  # row 6: device 3, process 1: exp overflows in "act"
    nan_in = x.copy()
    nan_in[1, 2] = np.nan  # row 1: device 0, process 0
    zero = x.copy()
    zero[5] = 0.0  # row 5: device 2: sqrt(0) in the backward of "norm"
    return {
        "overflow": (overflow, y),
        "input": (nan_in, y),
        "backward": (zero, y),
        "finite": (x, y),
    }


def _worker(out: str, pid: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=2,
        process_id=pid,
        initialization_timeout=30,
        heartbeat_timeout_seconds=20,
        shutdown_timeout_seconds=5,
    )
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    from jaxstable import diagnostics, distributed, train
    from jaxstable._src import _locate

    gathered = []
    real_gather = multihost_utils.process_allgather

    def counting_gather(x, *a, **k):
        got = real_gather(x, *a, **k)
        gathered.append(int(np.asarray(got).size))
        return got

    multihost_utils.process_allgather = counting_gather

    def no_eager(*a, **k):
        raise AssertionError("the eager op-by-op locate ran on a sharded step")

    _locate._eager = no_eager

    class Exp(nnx.Module):
        def __call__(self, x):
            return jnp.exp(x)

    class Norm(nnx.Module):
        def __call__(self, x):
            return jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))

    class MLP(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.l1 = nnx.Linear(4, 8, rngs=r)
            self.act = Exp()
            self.l2 = nnx.Linear(8, 8, rngs=r)
            self.norm = Norm()
            self.head = nnx.Linear(9, 3, rngs=r)

        def __call__(self, x):
            z = self.l1(x)
            h = self.l2(self.act(z * 3.0))
            return self.head(jnp.concatenate([h, self.norm(z)], -1))

    graphdef, params = nnx.split(MLP())

    def loss(p, batch):
        x, y = batch
        return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

    state = train.TrainState.create(params=params, optimizer=optax.adam(1e-2))
    mesh = distributed.make_mesh()
    assert mesh.devices.size == 4, jax.devices()
    state = distributed.shard_state(state, mesh, "fsdp")
    step = train.make_train_step(loss)
    lo, hi = pid * ROWS // 2, (pid + 1) * ROWS // 2
    result = {
        "split": not any(
            x.is_fully_addressable for x in jax.tree_util.tree_leaves(state.params)
        )
    }
    for name, batch in _batches().items():
        mine = jax.tree.map(lambda a: a[lo:hi], batch)
        batch = distributed.shard_batch(mine, mesh, process_local=True)
        del gathered[:]
        loc = diagnostics.locate(step, state, batch)
        result[name] = None if loc is None else loc._asdict()
        result[name + "_gathered"] = list(gathered)
    result["shard_map"] = _shard_map_location(graphdef, state, mesh, lo, hi)
    result["fit"] = _fit_location(state, step, mesh, lo, hi)
    result["program"], result["step"] = _memories(WIDE, mesh)
    with open(os.path.join(out, f"locate_{pid}.json"), "w") as f:
        json.dump(result, f, default=str)


def _shard_map_location(graphdef, state, mesh, lo: int, hi: int) -> dict | None:
    """The overflow batch through a loss whose ``act`` layer runs inside a
    ``shard_map`` over the global mesh."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jaxstable import diagnostics, distributed, train

    def loss(p, batch):
        x, y = batch
        model = nnx.merge(graphdef, p)
        act = jax.shard_map(
            model.act, mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
        h = model.l2(act(model.l1(x) * 3.0))
        out = model.head(jnp.concatenate([h, model.norm(model.l1(x))], -1))
        return jnp.mean((out - y) ** 2)

    mine = jax.tree.map(lambda a: a[lo:hi], _batches()["overflow"])
    batch = distributed.shard_batch(mine, mesh, process_local=True)
    loc = diagnostics.locate(train.make_train_step(loss), state, batch)
    return None if loc is None else loc._asdict()


def _fit_location(state, step, mesh, lo: int, hi: int) -> dict | None:
    """The location `fit` records for the overflow batch (fit gathers
    nothing before `locate`: every process locates on its own shards)."""
    import jax

    from jaxstable import distributed, train

    b = _batches()

    def load(batch):
        mine = jax.tree.map(lambda a: a[lo:hi], batch)
        return distributed.shard_batch(mine, mesh, process_local=True)

    _, hist = train.fit(
        state,
        step,
        [b["finite"], b["overflow"], b["finite"]],
        log=None,
        batch_transform=load,
    )
    return hist[1].get("location")


def _memories(width: int, mesh) -> tuple[dict, dict]:
    """XLA's memory analysis per device of the counting program and of the
    step, for an MLP of three ``width`` x ``width`` layers split over the
    mesh (FSDP) and a batch of ``width`` rows (compiled, not run)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxstable import distributed, train
    from jaxstable._src import locate_sharded, locate_shards

    class Wide(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.layers = nnx.List([nnx.Linear(width, width, rngs=r) for _ in range(3)])

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    graphdef, params = nnx.split(Wide())

    def loss(p, x):
        return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

    state = train.TrainState.create(params=params, optimizer=optax.adam(1e-2))
    state = distributed.shard_state(state, mesh, "fsdp")
    step = train.make_train_step(loss)
    rows = width // jax.process_count()
    batch = distributed.shard_batch(
        np.ones((rows, width), np.float32), mesh, process_local=True
    )
    args = (state.loss_scale, state.params, state.model_state, state.opt_state, batch)
    program = locate_shards.program_memory(
        locate_sharded._whole_step(step, state.tx), args, (step, "sharded", state.tx)
    )
    own = step.lower(state, batch).compile().memory_analysis()
    return program, locate_shards._memory(own)


def _launch(out) -> list:
    """Two worker processes (`test_multiprocess._launch`'s way, this
    module's worker); ``[(returncode, stderr)]``, every process killed by
    the timeout."""
    import subprocess
    import time

    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    )
    env["PJRT_NPROC"] = "8"
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    port, procs, logs = _free_port(), [], []
    try:
        for pid in range(2):
            logs.append(open(os.path.join(out, f"locate_{pid}.err"), "w+"))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        *("-m", "jaxstable.tests.test_locate_sharded"),
                        *(str(out), str(pid), str(port)),
                    ],
                    env=env,
                    cwd=root,
                    stdout=subprocess.DEVNULL,
                    stderr=logs[-1],
                )
            )
        start = time.monotonic()
        while any(p.poll() is None for p in procs):
            if time.monotonic() - start > TIMEOUT_S:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = []
    for p, log in zip(procs, logs, strict=True):
        log.seek(0)
        results.append((p.returncode, log.read()))
        log.close()
    return results


@pytest.fixture(scope="module")
def located(tmp_path_factory):
    out = tmp_path_factory.mktemp("locate_sharded")
    ends = _launch(out)
    for rc, err in ends:
        assert rc == 0, err[-3000:]
    found = []
    for pid in range(2):
        with open(os.path.join(out, f"locate_{pid}.json")) as f:
            found.append(json.load(f))
    return found


def test_weights_are_split_over_processes(located):
    assert all(r["split"] for r in located)


def test_forward_overflow_names_layer_op_process_and_device(located):
    a, b = (r["overflow"] for r in located)
    assert a == b  # every process gets the same answer
    assert a["phase"] == "forward" and a["path"] == "act" and a["op"] == "exp"
    assert "[process 1, device 3]" in a["detail"], a["detail"]
    assert "overflow" in a["detail"]


def test_bad_input_names_the_process_holding_its_rows(located):
    a, b = (r["input"] for r in located)
    assert a == b
    assert a["phase"] == "input" and a["nan_count"] == 1
    assert "[process 0, device 0]" in a["detail"], a["detail"]


def test_backward_names_the_layer_and_the_device(located):
    a, b = (r["backward"] for r in located)
    assert a == b
    assert a["phase"] == "backward", a
    assert a["path"] == "l1.bias" or a["path"].startswith("l1."), a
    assert "in norm" in a["detail"] and "[process 1, device 2]" in a["detail"], a


def test_inside_shard_map_names_layer_op_and_device(located):
    a, b = (r["shard_map"] for r in located)
    assert a == b
    assert (a["phase"], a["path"], a["op"]) == ("forward", "act", "exp"), a
    assert a["detail"].endswith("[process 1, device 3]"), a


def test_fit_records_the_location(located):
    a, b = (r["fit"] for r in located)
    assert a == b and a is not None
    assert (a["phase"], a["path"], a["op"]) == ("forward", "act", "exp"), a
    assert a["detail"].endswith("[process 1, device 3]"), a


def test_finite_step_is_none(located):
    assert all(r["finite"] is None for r in located)


def test_only_a_few_numbers_per_device_cross_processes(located):
    """No array leaf (the smallest here has 3 elements, the largest 72 per
    process) is ever gathered: each gather is of one row per process or
    of a few numbers per device."""
    for r in located:
        for name in ("overflow", "input", "backward", "finite"):
            sizes = r[name + "_gathered"]
            assert all(n <= 2 * 2 * 7 for n in sizes), (name, sizes)


def test_program_memory_is_about_the_steps(located):
    """XLA's memory analysis per device: arguments, outputs and
    temporaries of the counting program against the step's (its new
    parameters and optimizer state are outputs, the program's a few
    flags)."""
    for r in located:
        prog, step = r["program"], r["step"]
        total = prog["argument"] + prog["output"] + prog["temp"]
        own = step["argument"] + step["output"] + step["temp"]
        assert prog["argument"] <= step["argument"]
        assert total <= 1.05 * own, (prog, step)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
