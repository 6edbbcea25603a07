"""The guarded train step on a 4-device mesh: data parallel and FSDP.

JAX fixes its device count when it first starts, and conftest.py has already
started it with one CPU device; so the multi-device runs happen in ONE
subprocess (``python -m jaxstable.tests.test_distributed OUT``) started with
``--xla_force_host_platform_device_count=4``. It trains the same small MLP
from the same weights on the same 56 global batches three times: unsharded
on one device, data parallel on 4 devices, FSDP on 4 devices, all under
``jax.transfer_guard("disallow")``, and writes the per-step results and the
compiled programs' collective counts to an .npz that the tests read.

Batches 7, 20, 33 and 45 are poisoned with NaN/inf INPUTS; 20, 33 and 45
only in the rows of one device (one replica's slice): the global gradient is
then non-finite, so every replica must skip and back the scale off once.
Batch 33 holds a single +inf, x[0, 5] (device 0's rows): tanh saturates and
its derivative is exactly 0, so only row 5 of w1's gradient is 0*inf = NaN;
under FSDP that row lives on device 2: the devices' local gradient shards
disagree and only the global flag makes all of them skip.
The same problem (weights, batches, poison) is `torchref.tests.
test_distributed.problem`, for the cross-framework parity test.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import has_conditional, tolerance
from jaxstable import distributed, train, transforms
from jaxstable import loss_scale as jls

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

DEVICES = 4
STEPS = 56
BATCH = 16  # global; 4 rows per device
IN, HIDDEN, OUT = 8, 16, 3  # OUT=3: b2 has no axis divisible by 4 (replicated)
# step -> the x entries poisoned (NaN, except 33: +inf).
POISON = {7: (slice(None),), 20: (slice(8, 12),), 33: (0, 5), 45: (slice(4, 8),)}
TIMEOUT_S = 120


def problem(seed: int = 0):
    """Initial weights (x @ w layout) and the global batches, as numpy."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(0, 0.4, (IN, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, 0.4, (HIDDEN, OUT)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }
    batches = []
    for i in range(STEPS):
        x = rng.normal(size=(BATCH, IN)).astype(np.float32)
        y = rng.normal(size=(BATCH, OUT)).astype(np.float32)
        if i in POISON:
            x[POISON[i]] = np.inf if i == 33 else np.nan
        batches.append((x, y))
    return params, batches


def mlp_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


@functools.cache
def optimizer():
    # One object: every state then has the same (static) tx, so a step
    # compiled for one run is reused for a state restored or re-created.
    return transforms.stable_optimizer(optax.adam(1e-2), max_grad_norm=1.0)


def initial_state(params):
    # period=8: the scale grows several times between the poisoned steps.
    ls = jls.DynamicLossScale(loss_scale=2.0**10, period=8)
    return train.TrainState.create(params=params, optimizer=optimizer(), loss_scale=ls)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


def _flat_params(params) -> np.ndarray:
    # torch's parameter order (the dict's leaves would be sorted by key).
    return np.concatenate([np.ravel(params[k]) for k in ("w1", "b1", "w2", "b2")])


def shard_map_step(mesh, step, check_vma=True):
    """``step`` run by `jax.shard_map`: each device its rows, state replicated."""
    spec = jax.sharding.PartitionSpec
    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(spec(), spec(distributed.DATA_AXIS)),
            out_specs=spec(),
            check_vma=check_vma,
        )
    )


def run_trajectory(mesh, strategy, params, batches):
    """Trains STEPS steps; returns per-step arrays and a few checks.

    ``strategy``: None (one device), one of `distributed.STRATEGIES`, or
    "shard_map" (the state replicated, the step built with ``axis_name``).
    """
    state = initial_state({k: jnp.asarray(v) for k, v in params.items()})
    step = train.make_train_step(mlp_loss)
    if strategy == "shard_map":
        axis = distributed.DATA_AXIS
        step = shard_map_step(mesh, train.make_train_step(mlp_loss, axis_name=axis))
    if mesh is not None:
        placement = "data_parallel" if strategy == "shard_map" else strategy
        state = distributed.shard_state(state, mesh, placement)
        batches = [distributed.shard_batch(b, mesh) for b in batches]
    else:
        batches = [jax.device_put(b) for b in batches]
    specs_in = jax.tree.map(lambda a: a.sharding, state)
    states, metrics = [], []
    # Nothing moves between host and device inside the loop: the step never
    # syncs, and every input is already placed.
    with jax.transfer_guard("disallow"):
        for b in batches:
            state, m = step(state, b)
            states.append(state)
            metrics.append(m)
    same_sharding = jax.tree.map(lambda a, s: a.sharding == s, state, specs_in)
    host = jax.device_get((states, metrics))
    out = {
        "params": np.stack([_flat_params(s.params) for s in host[0]]),
        "opt_state": np.stack([_flat(s.opt_state) for s in host[0]]),
        # Adam's state inside the skip transform (whose counters do move).
        "adam_state": np.stack([_flat(s.opt_state.inner_state) for s in host[0]]),
        "loss_scale": np.array([float(s.loss_scale.loss_scale) for s in host[0]]),
        "skipped_total": np.array([int(s.skipped_total) for s in host[0]]),
        "finite": np.array([bool(m["finite"]) for m in host[1]]),
        "grads_finite": np.array([bool(m["grads_finite"]) for m in host[1]]),
        "loss": np.array([float(m["loss"]) for m in host[1]]),
        "replicas_identical": np.array(
            [distributed.replicas_identical(s) for s in states]
        ),
        "sharding_kept": np.array(all(jax.tree_util.tree_leaves(same_sharding))),
    }
    if mesh is not None:
        out["specs"] = np.array(
            json.dumps(jax.tree.map(lambda a: str(a.sharding.spec), state.params))
        )
    return out, step, states, batches


def _plain_step(params, opt_state, batch):
    """The same update with plain optax: no loss scale, no skip."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    grads = jax.grad(mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _all_reduce_types(text: str) -> list[str]:
    """The result type of each all-reduce, e.g. ``(pred[], pred[])``."""
    return re.findall(r"= (\S+|\([^)]*\)) all-reduce(?:-start)?\(", text)


def _summary(compiled) -> dict:
    text = compiled.as_text()
    counts = distributed.count_collectives(text)
    types = _all_reduce_types(text)
    assert len(types) == counts.get("all-reduce", 0), types
    # An all-reduce of boolean scalars only: the guard's finiteness flags.
    counts["flag all-reduce"] = sum(
        set(re.findall(r"\w+\[[^\]]*\]", t)) == {"pred[]"} for t in types
    )
    return counts


def collectives(mesh, strategy, step, state, batch):
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    guarded = _summary(compiled)
    guarded["has_conditional"] = has_conditional(lowered)
    if strategy == "shard_map":
        # No plain step compiled (a few seconds): the all-reduces' operand
        # types say what they carry.
        types = _all_reduce_types(compiled.as_text())
        return {"guarded": guarded, "all_reduce_types": types}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    plain_state = train.TrainState.create(params=state.params, optimizer=tx)
    placed = distributed.shard_state(plain_state, mesh, strategy)
    plain = jax.jit(_plain_step).lower(placed.params, placed.opt_state, batch)
    return {"guarded": guarded, "plain": _summary(plain.compile())}


def _checker_results():
    mesh = distributed.make_mesh(DEVICES)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def copies(last):
        bufs = [np.zeros(3, np.float32) for _ in range(DEVICES)]
        bufs[-1][1] = last
        arrays = [
            jax.device_put(b, d) for b, d in zip(bufs, mesh.devices.flat, strict=True)
        ]
        return jax.make_array_from_single_device_arrays((3,), sharding, arrays)

    return {
        "checker_on_differing_copies": distributed.replicas_identical(copies(1e-30)),
        "checker_on_equal_copies": distributed.replicas_identical(copies(0.0)),
    }


def _local_shards_finite(params, batches) -> np.ndarray:
    """Per device: are its FSDP shards of batch 33's gradients all finite?

    The gradients at the initial weights, placed as FSDP places the params.
    No collective reduces these flags: each device looks at its own shards.
    """
    mesh = distributed.make_mesh(DEVICES)
    state = distributed.shard_state(initial_state(params), mesh, "fsdp")
    shardings = jax.tree.map(lambda a: a.sharding, state.params)
    grads = jax.jit(jax.grad(mlp_loss), out_shardings=shardings)(
        state.params, distributed.shard_batch(batches[33], mesh)
    )
    flags = {d: True for d in mesh.devices.flat}
    for leaf in jax.tree_util.tree_leaves(grads):
        for shard in leaf.addressable_shards:
            flags[shard.device] &= bool(np.isfinite(np.asarray(shard.data)).all())
    return np.array([flags[d] for d in mesh.devices.flat])


def _local_flag_step(state, batch):
    """A naive shard_map port of the guard: the gradients are pmean-ed, but
    the flag is each replica's test of its OWN gradients, never reduced."""
    grad_fn = jls.scaled_value_and_grad(mlp_loss)
    _, grads, local_finite = grad_fn(state.loss_scale, state.params, batch)
    grads = jax.lax.pmean(grads, distributed.DATA_AXIS)
    updates, opt_state = state.tx.update(
        grads, state.opt_state, state.params, grads_finite=local_finite
    )
    return state.replace(
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        loss_scale=state.loss_scale.adjust(local_finite),
    )


def _local_flag_run(mesh, state, batch):
    """One naive step (batch 20: NaN in device 2's rows only) from the state
    the shard_map run had before it; check_vma=False lets each device return
    its own copy of the "replicated" state."""
    new = shard_map_step(mesh, _local_flag_step, check_vma=False)(state, batch)
    copies = [float(s.data) for s in new.loss_scale.loss_scale.addressable_shards]
    return {
        "local_flag/scale_before": np.array(float(state.loss_scale.loss_scale)),
        "local_flag/scale_copies": np.array(copies),
        "local_flag/replicas_identical": np.array(distributed.replicas_identical(new)),
    }


CUT = 25  # checkpoint after this many steps: batches 33 and 45 are still ahead


def _continue(step, state, batches):
    params, scales, skipped = [], [], []
    for b in batches:
        state, _ = step(state, b)
        host = jax.device_get(state)
        params.append(_flat_params(host.params))
        scales.append(float(host.loss_scale.loss_scale))
        skipped.append(int(host.skipped_total))
    return np.stack(params), np.array(scales), np.array(skipped)


def _checkpoint_crossings(runs, tmp):
    """Save at CUT from FSDP, restore onto one device and go on; and back."""
    out = {}
    for src, dst in (("fsdp", "one"), ("one", "fsdp")):
        path = os.path.join(tmp, f"ckpt_{src}")
        train.save_checkpoint(path, runs[src][1][CUT - 1])
        # The target: a state of the other run (its first step's), so its
        # values differ and its placement is the one that run's step takes.
        target = runs[dst][1][0]
        restored = train.load_checkpoint(path, target)
        same = jax.tree.map(lambda a, t: a.sharding == t.sharding, restored, target)
        out[f"{src}_to_{dst}/sharding_of_target"] = np.array(
            all(jax.tree_util.tree_leaves(same))
        )
        step, _, placed = runs[dst]
        p, scale, skipped = _continue(step, restored, placed[CUT:])
        out[f"{src}_to_{dst}/params"] = p
        out[f"{src}_to_{dst}/loss_scale"] = scale
        out[f"{src}_to_{dst}/skipped_total"] = skipped
    return out


def _fit_resumed(mesh, params, batches, step, tmp):
    """fit on an FSDP state, global batches placed by batch_transform: 30
    steps with checkpoints, then the same call resumed to the end."""

    def fresh():
        state = initial_state({k: jnp.asarray(v) for k, v in params.items()})
        return distributed.shard_state(state, mesh, "fsdp")

    kwargs = dict(
        checkpoint_dir=os.path.join(tmp, "fit"),
        progress=False,
        batch_transform=functools.partial(distributed.shard_batch, mesh=mesh),
    )
    _, first = train.fit(
        fresh(), step, batches, steps=30, checkpoint_every=10, **kwargs
    )
    state, rest = train.fit(fresh(), step, batches, resume=True, **kwargs)
    same = jax.tree.map(lambda a, t: a.sharding == t.sharding, state, fresh())
    hist = first + rest
    return {
        "fit/step": np.array([h["step"] for h in hist]),
        "fit/loss_scale": np.array([h["loss_scale"] for h in hist]),
        "fit/finite": np.array([h["finite"] for h in hist]),
        "fit/skipped_total": np.array([h["skipped_total"] for h in hist]),
        "fit/final_params": _flat_params(jax.device_get(state.params)),
        "fit/sharding_kept": np.array(all(jax.tree_util.tree_leaves(same))),
    }


def _worker(out_path: str) -> None:
    # One program in flight at a time: the forced host devices' threads meet
    # in each all-reduce, and queued steps only add contention on 2 cores.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    assert jax.device_count() == DEVICES, jax.devices()
    params, batches = problem()
    results = {}
    ref, one_step, one_states, one_batches = run_trajectory(None, None, params, batches)
    results.update({f"one/{k}": v for k, v in ref.items()})
    counts, runs = {}, {}
    mesh = distributed.make_mesh(DEVICES)
    for strategy in (*distributed.STRATEGIES, "shard_map"):
        res, step, states, placed = run_trajectory(mesh, strategy, params, batches)
        results.update({f"{strategy}/{k}": v for k, v in res.items()})
        counts[strategy] = collectives(mesh, strategy, step, states[-1], placed[0])
        runs[strategy] = (step, states, placed)
    results["collectives"] = np.array(json.dumps(counts))
    step, states, placed = runs["shard_map"]
    results.update(_local_flag_run(mesh, states[19], placed[20]))
    runs["one"] = (one_step, one_states, one_batches)
    tmp = os.path.dirname(out_path)
    results.update(_checkpoint_crossings(runs, tmp))
    results.update(_fit_resumed(mesh, params, batches, runs["fsdp"][0], tmp))
    results.update(_checker_results())
    results["fsdp_local_shards_finite_33"] = _local_shards_finite(params, batches)
    np.savez(out_path, **results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "runs.npz"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    )
    # Each forced device runs its part of a step on a thread of the PjRt CPU
    # client's pool, whose size is the core count (2 here) unless PJRT_NPROC
    # says otherwise; the parts meet in every all-reduce, so with fewer
    # threads than devices the last part may never start: XLA aborted after
    # 40 s with 3 of 4 device threads in the rendezvous (1 of 3 runs). With 8
    # threads: 4 of 4 concurrent runs passed.
    env["PJRT_NPROC"] = str(2 * DEVICES)
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxstable.tests.test_distributed", str(out)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


ALL_RUNS = (*distributed.STRATEGIES, "shard_map")


@pytest.mark.parametrize("strategy", ALL_RUNS)
def test_sharded_run_equals_one_device_run(runs, strategy):
    one = {k[4:]: v for k, v in runs.items() if k.startswith("one/")}
    got = {k[len(strategy) + 1 :]: v for k, v in runs.items() if k.startswith(strategy)}
    # The poisoned steps are skipped, in both runs, and nothing else is.
    assert sorted(np.flatnonzero(~one["finite"])) == sorted(POISON)
    for key in ("loss_scale", "skipped_total", "finite", "grads_finite"):
        np.testing.assert_array_equal(got[key], one[key], err_msg=key)
    # Summation order differs (per-device partial sums), hence a tolerance.
    for key in ("params", "opt_state"):
        np.testing.assert_allclose(
            got[key], one[key], **tolerance("float32_trajectory"), err_msg=key
        )
    assert np.isfinite(got["params"]).all()
    assert bool(got["sharding_kept"]), "the step changed the state's shardings"


def test_fsdp_shards_divisible_leaves_and_replicates_the_rest(runs):
    specs = json.loads(str(runs["fsdp/specs"]))
    assert specs == {
        "w1": "P('data',)",
        "b1": "P('data',)",
        "w2": "P('data',)",
        "b2": "P()",  # 3 rows on 4 devices
    }
    assert set(json.loads(str(runs["data_parallel/specs"])).values()) == {"P()"}


@pytest.mark.parametrize("strategy", ALL_RUNS)
def test_one_poisoned_shard_every_replica_skips(runs, strategy):
    scale = runs[f"{strategy}/loss_scale"]
    skipped = runs[f"{strategy}/skipped_total"]
    for i in (20, 33, 45):  # only one device's rows are non-finite
        assert not runs[f"{strategy}/finite"][i]
        assert skipped[i] == skipped[i - 1] + 1
        # Once: the scale after the step is half the one before.
        assert scale[i] == scale[i - 1] / 2
        np.testing.assert_array_equal(
            runs[f"{strategy}/params"][i], runs[f"{strategy}/params"][i - 1]
        )
        np.testing.assert_array_equal(
            runs[f"{strategy}/adam_state"][i], runs[f"{strategy}/adam_state"][i - 1]
        )
    # Every copy of every replicated leaf (all of them in data parallel; the
    # loss scale, counters and b2 in FSDP) is bitwise equal after every step.
    assert runs[f"{strategy}/replicas_identical"].all()


def test_fsdp_devices_disagree_locally_and_all_skip(runs):
    # Batch 33's NaN gradient row (w1[5]) lies in device 2's shard only: the
    # devices' own shards disagree, so only a global flag makes all skip
    # (as they do, test_one_poisoned_shard_every_replica_skips).
    assert runs["fsdp_local_shards_finite_33"].tolist() == [True, True, False, True]
    assert not runs["fsdp/grads_finite"][33]


def test_compiled_step_collectives(runs):
    counts = json.loads(str(runs["collectives"]))
    for strategy, c in counts.items():
        assert "conditional" not in c["guarded"], (strategy, c)
        assert not c["guarded"].pop("has_conditional"), strategy
        if strategy != "shard_map":
            assert c["plain"]["flag all-reduce"] == 0, (strategy, c)
    dp, fsdp, smap = counts["data_parallel"], counts["fsdp"], counts["shard_map"]
    # shard_map with axis_name: ONE all-reduce in all, of float32 operands
    # only (the 4 gradient leaves and the loss, combined by XLA): the flag is
    # taken from the averaged gradients and adds no collective.
    assert smap["guarded"] == {"all-reduce": 1, "flag all-reduce": 0}, smap
    [types] = smap["all_reduce_types"]
    assert set(re.findall(r"(\w+)\[", types)) == {"f32"}, types
    # Data parallel: XLA combines the gradient all-reduces into one op; the
    # guard tests the already replicated gradients locally: no collective.
    assert dp["guarded"] == dp["plain"] == {"all-reduce": 1, "flag all-reduce": 0}
    # FSDP: the gradients' finiteness is their scaled sum of squares, which
    # the norm all-reduces anyway, and the update check's sums join the same
    # combined all-reduce of floats: no all-reduce of boolean flags; the
    # gradient and norm reductions are those of the plain step (XLA may
    # combine them differently, so their op count is only bounded).
    assert fsdp["guarded"]["flag all-reduce"] == 0, fsdp
    assert fsdp["guarded"]["all-gather"] == fsdp["plain"]["all-gather"], fsdp
    assert fsdp["guarded"]["all-reduce"] <= fsdp["plain"]["all-reduce"] + 1, fsdp


def test_shard_map_flag_from_local_gradients_diverges(runs):
    # The same shard_map step with the flag taken from each replica's own
    # gradients (not from their mean): at batch 20 (NaN in device 2's rows)
    # device 2 halves its scale, the others see finite local gradients and
    # do not, so the "replicated" loss scale differs between devices. The
    # update check keeps the params (the averaged update is NaN everywhere);
    # the replicas still disagree, and replicas_identical says so.
    before = float(runs["local_flag/scale_before"])
    copies = runs["local_flag/scale_copies"].tolist()
    assert copies[2] == before / 2, copies
    assert all(c != before / 2 for i, c in enumerate(copies) if i != 2), copies
    assert not runs["local_flag/replicas_identical"]
    # With axis_name the flag comes from the averaged gradients: all halve.
    assert runs["shard_map/loss_scale"][20] == runs["shard_map/loss_scale"][19] / 2


@pytest.mark.parametrize(("src", "dst"), [("fsdp", "one"), ("one", "fsdp")])
def test_checkpoint_restores_across_shardings(runs, src, dst):
    # Saved after CUT steps of one run, restored onto a state of the other
    # (placed as that one is), then trained on: the same trajectory as the
    # uninterrupted source run, poisoned batches 33 and 45 included.
    pre = f"{src}_to_{dst}"
    assert bool(runs[f"{pre}/sharding_of_target"])
    for key in ("loss_scale", "skipped_total"):
        np.testing.assert_array_equal(
            runs[f"{pre}/{key}"], runs[f"{src}/{key}"][CUT:], err_msg=key
        )
    np.testing.assert_allclose(
        runs[f"{pre}/params"],
        runs[f"{src}/params"][CUT:],
        **tolerance("float32_trajectory"),
    )


def test_fit_on_fsdp_state_with_checkpoint_resume(runs):
    # train.fit with an FSDP state and batch_transform=shard_batch: 30 steps
    # with checkpoints, then the same call with resume=True to the end.
    np.testing.assert_array_equal(runs["fit/step"], np.arange(STEPS))
    np.testing.assert_array_equal(runs["fit/finite"], runs["fsdp/finite"])
    np.testing.assert_array_equal(runs["fit/skipped_total"], runs["fsdp/skipped_total"])
    # A record's loss_scale is the scale its step used: the one before it.
    np.testing.assert_array_equal(
        runs["fit/loss_scale"][1:], runs["fsdp/loss_scale"][:-1]
    )
    np.testing.assert_allclose(
        runs["fit/final_params"],
        runs["fsdp/params"][-1],
        **tolerance("float32_trajectory"),
    )
    assert bool(runs["fit/sharding_kept"])


def test_fit_batch_transform_runs_after_the_resume_skip(tmp_path):
    # Same test as torchref's: the transform sees only the batches it runs.
    state = train.TrainState.create(params=jnp.zeros(2), optimizer=optax.sgd(0.1))
    step = train.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))
    data = [np.full(2, float(i), np.float32) for i in range(4)]
    seen = []

    def transform(b):
        seen.append(float(b[0]))
        return jnp.asarray(b) * 2

    kwargs = dict(checkpoint_dir=tmp_path, progress=False, batch_transform=transform)
    _, hist = train.fit(state, step, data, steps=2, **kwargs)
    train.fit(state, step, data, resume=True, **kwargs)
    assert seen == [0.0, 1.0, 2.0, 3.0]
    # The step trained on the transformed batches (2*i), not on data.
    assert hist[0]["loss"] == 0.0 and hist[1]["loss"] == 8.0
    with pytest.raises(TypeError, match="batch_transform must be None or a callable"):
        train.fit(state, step, data, batch_transform=2, log=None)


def test_axis_name_refuses_bad_input():
    with pytest.raises(TypeError, match="axis_name must be None or a str"):
        train.make_train_step(mlp_loss, axis_name=0)
    # Params split over the axis (in_specs P("data") for the state): the
    # step averages gradients of replicated params only, so it refuses.
    mesh = distributed.make_mesh(1)
    spec = jax.sharding.PartitionSpec
    step = train.make_train_step(mlp_loss, axis_name=distributed.DATA_AXIS)
    params, batches = problem()
    state = distributed.shard_state(initial_state(params), mesh, "fsdp")
    specs = jax.tree.map(lambda a: a.sharding.spec, state)
    bad = jax.shard_map(
        step, mesh=mesh, in_specs=(specs, spec("data")), out_specs=spec()
    )
    with pytest.raises(ValueError, match=r"params leaf \['b1'\] varies over 'data'"):
        bad(state, distributed.shard_batch(batches[0], mesh))


def test_axis_name_not_mapped_and_shard_map_without_axis_name_are_refused():
    # Issue 26 item 7: an axis_name the shard_map does not map gave a bare
    # AssertionError from lax.pcast; a step without axis_name inside
    # shard_map(check_vma=False) let each replica apply its own gradient
    # (the "replicated" state silently differed between devices).
    mesh = distributed.make_mesh(1)
    params, batches = problem()
    state = distributed.shard_state(initial_state(params), mesh)
    batch = distributed.shard_batch(batches[0], mesh)
    wrong = shard_map_step(mesh, train.make_train_step(mlp_loss, axis_name="batch"))
    with pytest.raises(
        ValueError,
        match=r"axis_name='batch'\): 'batch' is not a mapped axis here; the "
        r"enclosing jax.shard_map maps the axes \('data',\)",
    ):
        wrong(state, batch)
    for check_vma in (False, True):
        bare = shard_map_step(mesh, train.make_train_step(mlp_loss), check_vma)
        with pytest.raises(ValueError, match=r"built with axis_name=None.*'data'"):
            bare(state, batch)
    # global_mean names the same mistakes.
    with pytest.raises(ValueError, match=r"not called inside jax\.shard_map"):
        distributed.global_mean(jnp.ones(2), axis_name="data")


@pytest.mark.parametrize(
    ("values", "mask", "expected"),
    [
        ([1.0, 2.0, 4.0], None, 7 / 3),
        ([1.0, 2.0, 4.0], [True, False, True], 2.5),
        ([1.0, 2.0, 4.0], [0.5, 0.0, 1.5], (0.5 + 6.0) / 2.0),
        # A masked-out NaN / inf (a padded row) does not reach the mean.
        ([1.0, np.nan, np.inf], [True, False, False], 1.0),
        # Nothing counted: 0, not torch's 0/0 = NaN.
        ([1.0, 2.0], [False, False], 0.0),
        (np.zeros((0,), np.float32), None, 0.0),
    ],
)
def test_global_mean_one_device(values, mask, expected):
    values = jnp.asarray(values, jnp.float16)  # computed in float32
    got = distributed.global_mean(values, mask)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), expected, rtol=1e-6)
    grad = jax.grad(lambda v: distributed.global_mean(v, mask))(values)
    assert bool(jnp.all(jnp.isfinite(grad)))
    if not np.any(np.asarray(mask if mask is not None else values.size > 0)):
        assert not bool(jnp.any(grad))  # the all-ignored batch: zero gradient


def test_shard_batch_names_the_bad_leaf():
    mesh = distributed.make_mesh(1)
    with pytest.raises(ValueError, match=r"\['y'\] has shape \(\)"):
        distributed.shard_batch({"x": jnp.ones((2, 3)), "y": jnp.float32(1)}, mesh)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_devices must be an int in"):
        distributed.make_mesh(jax.device_count() + 1)
    state = initial_state({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="strategy must be one of"):
        distributed.state_sharding(state, distributed.make_mesh(1), "zero3")
    with pytest.raises(ValueError, match=r"1-D jax\.sharding\.Mesh"):
        distributed.shard_state(state, "data")


def test_replicas_identical_sees_a_differing_copy(runs):
    # A "replicated" array whose copies were made to differ in one element
    # (built from per-device buffers in the subprocess): the check says so.
    assert not runs["checker_on_differing_copies"]
    assert runs["checker_on_equal_copies"]


if __name__ == "__main__":
    _worker(sys.argv[1])
