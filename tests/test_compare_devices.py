"""`examples/compare.py --devices N`: data parallel runs equal the 1-device run.

One subprocess (JAX needs its own process for 2 forced host CPU devices)
trains the segmentation task's stable float32 run four times from the same
weights on the same global batches: JAX on 1 and on 2 devices, torch in 1
and in 2 DDP processes, through the harness (`train_and_evaluate`, as
compare.py does). One image of the second batch holds a NaN pixel in the
second half of the batch, the rows of device / rank 1 only: the issue's
"one shard poisoned" case, which only the global skip decision handles (a
replica deciding from its own rows would apply the step on device 0 and
skip it on device 1). The same subprocess trains the contrastive task's
torch run in 1 and in 2 DDP processes (InfoNCE over the gathered global
batch) and computes the OCR, contrastive and detection JAX losses of
`tests/test_global_loss.py`'s cases on 2 devices (one jitted program). The
rest is checked in this process: the command line, the configs and the
report section.
"""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from examples import compare, harness
from examples.harness import devices
from tests import test_global_loss

# end-to-end runs (in a subprocess, which inherits the setting): queued
# first, compiled with fewer XLA optimisations (conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fewer_xla_optimizations")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
POISONED = 1  # the batch with a NaN pixel in its second half
TIMEOUT_S = 300  # the subprocess as a whole (about 30 s on a quiet 2-core box)


def _runs(out: str) -> None:
    """In the subprocess: the four runs, pickled into `out`."""
    from examples.segmentation.task import TASK

    config = TASK.get_config(**{**TASK.quick, "steps": STEPS})
    weights = TASK.initial_weights(config)
    batches = TASK.train_batches(config)
    image = batches[POISONED]["image"].copy()
    image[-1, 0, 0, 0] = np.nan  # the last row: device / rank 1 of 2
    batches[POISONED] = {**batches[POISONED], "image": image}
    heldout = TASK.heldout_set(config)
    runs = {
        (fw, n): harness.train_and_evaluate(
            TASK,
            fw,
            config.replace(devices=n),
            weights=weights,
            batches=batches,
            heldout=heldout,
            progress=False,
        )
        for fw in ("jax", "torch")
        for n in (1, 2)
    }
    # contrastive float32: InfoNCE over the global batch, every rank's
    # captions negatives.
    runs["contrastive"] = _torch_runs_in_1_and_2("examples.contrastive.task")
    # detection float16, 3 steps: at the default scale 2**16 one device skips
    # steps 0 and 2; a rank backpropagating its own mean (2x its share)
    # skipped step 1 too.
    runs["fp16"] = _torch_runs_in_1_and_2(
        "examples.detection.task", steps=3, precision="float16"
    )
    runs["jax_losses"] = test_global_loss.jax_global_losses()
    with open(out, "wb") as f:
        pickle.dump(runs, f)


def _torch_runs_in_1_and_2(task_module: str, **overrides) -> dict:
    """A torch stable run of `task_module`'s quick config in 1 and in 2 DDP
    processes, from the same weights and batches."""
    import importlib

    task = importlib.import_module(task_module).TASK
    config = task.get_config(**{**task.quick, **overrides})
    args = dict(weights=task.initial_weights(config),
                batches=task.train_batches(config),
                heldout=task.heldout_set(config), progress=False)  # fmt: skip
    return {
        n: harness.train_and_evaluate(task, "torch", config.replace(devices=n), **args)
        for n in (1, 2)
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("devices") / "runs.pkl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(_compile_cache_env())
    code = (
        "from examples.harness import devices; devices.force_host_devices(2); "
        "from tests.test_compare_devices import _runs; import sys; _runs(sys.argv[1])"
    )
    # start_new_session: on a timeout the whole group (the torch ranks
    # included) is killed, not only the python it started
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def _compile_cache_env() -> dict[str, str]:
    """The session's JAX compilation cache (conftest) for the subprocess:
    its 1-device JAX run compiles the step `tests/test_compare.py` did."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size",
             "jax_persistent_cache_min_compile_time_secs")  # fmt: skip
    if not jax.config.jax_compilation_cache_dir:
        return {}
    return {name.upper(): str(getattr(jax.config, name)) for name in names}


def _decisions(r):
    return [(m["finite"], m["skipped_total"], m["loss_scale"]) for m in r.metrics]


@pytest.mark.parametrize("fw", ["jax", "torch"])
def test_two_devices_equal_one_device(runs, fw, tol):
    one, two = runs[fw, 1], runs[fw, 2]
    assert one.replicas is None and two.config.devices == 2
    assert two.replicas == {
        "devices": 2,
        "replicas_identical": True,  # every copy of the final model
        "ranks_agree": True,  # every rank's records (torch: 2 processes)
    }
    # the poisoned batch is skipped on every replica, as on one device
    finite = [m["finite"] for m in two.metrics]
    assert finite == [i != POISONED for i in range(STEPS)]
    assert _decisions(two) == _decisions(one)
    loss1 = np.array([m["loss"] for m in one.metrics])
    loss2 = np.array([m["loss"] for m in two.metrics])
    # NaN at the poisoned step in both, the float32 trajectory elsewhere
    np.testing.assert_allclose(loss2, loss1, **tol("float32_trajectory"))
    np.testing.assert_allclose(
        two.scores["miou"], one.scores["miou"], **tol("float32_trajectory")
    )
    row = devices.one_device_agreement([two], [one])[0]
    assert row["same_decisions"]
    assert row["max_rel_loss_diff"] <= tol("float32_trajectory")["rtol"]


def test_contrastive_two_processes_equal_one(runs, tol):
    one, two = runs["contrastive"][1], runs["contrastive"][2]
    assert two.replicas == {"devices": 2, "replicas_identical": True,
                            "ranks_agree": True}  # fmt: skip
    assert _decisions(two) == _decisions(one)
    row = devices.one_device_agreement([two], [one])[0]
    assert row["same_decisions"]
    # a rank's own InfoNCE (4 of the 8 captions as negatives) is another
    # loss (test_global_loss): this is the global one, every step
    assert row["max_rel_loss_diff"] <= 1e-5
    for key in one.scores:
        np.testing.assert_allclose(two.scores[key], one.scores[key], rtol=1e-5)


def test_float16_two_processes_skip_as_one_device(runs):
    # The stable step drives the DDP wrapper (TrainStep's data-parallel
    # step: loss / 2 per rank, gradients summed): one device's float16
    # headroom, hence its skips and scales, step by step.
    one, two = runs["fp16"][1], runs["fp16"][2]
    assert [m["finite"] for m in one.metrics] == [False, True, False]
    assert _decisions(two) == _decisions(one)
    assert two.replicas["replicas_identical"] and two.replicas["ranks_agree"]


@pytest.mark.parametrize("naive", [False, True], ids=["stable", "naive"])
@pytest.mark.parametrize("task", ["ocr", "contrastive", "detection"])
def test_jax_loss_on_two_devices_is_the_global_one(runs, task, naive):
    """JAX's loss of outputs split over 2 devices (one SPMD program) equals
    torch's loss of the whole batch in one process, value and gradient."""
    loss2, grads2, sharded = runs["jax_losses"][task, naive]
    assert sharded
    outputs, batch, loss = test_global_loss.CASES[task](np.random.default_rng(0))
    leaves = test_global_loss._leaves(outputs)
    ref = loss(leaves, batch, naive)
    ref.backward()
    np.testing.assert_allclose(loss2, float(ref.detach()), rtol=1e-5)
    for key, leaf in leaves.items():
        want = leaf.grad.numpy()
        if task == "detection":  # JAX's outputs are NHWC
            want = np.moveaxis(want, 1, -1)
        scale = np.abs(want).max()
        np.testing.assert_allclose(grads2[key], want, rtol=0, atol=1e-5 * scale)


def test_report_names_the_device_count(runs):
    two = [runs["jax", 2], runs["torch", 2]]
    summary = {
        "config": two[0].config.as_dict(),
        "runs": [r.summary() for r in two],
        "one_device": devices.one_device_agreement(
            two, [runs["jax", 1], runs["torch", 1]]
        ),
    }
    text = "\n".join(devices.devices_report(summary))
    assert text.startswith("## 2 devices")
    assert "| jax float32 stable | True | True |" in text
    assert "| torch float32 stable | True | True |" in text
    assert "Agreement with 1 device" in text


@pytest.mark.parametrize("name", ["segmentation", "ocr", "contrastive", "detection"])
def test_every_task_takes_devices(name):
    args = compare.parse_args([name, "--devices", "2", "--quick"])
    assert harness.base_config(args).devices == 2


def test_devices_option_is_refused_where_unsupported(capsys):
    import dataclasses

    tasks = compare.tasks()
    tasks["ocr"] = dataclasses.replace(tasks["ocr"], multi_device=False)
    with pytest.raises(SystemExit):
        harness.parse_args(tasks, ["ocr", "--devices", "2"])
    err = capsys.readouterr().err
    assert "--devices > 1 is supported for ['segmentation', 'contrastive', " in err
    with pytest.raises(ValueError, match="batch_size must be a multiple of devices"):
        harness.BaseConfig(batch_size=3, devices=2)


def test_force_host_devices_refuses_a_started_backend(monkeypatch):
    import jax

    monkeypatch.setenv("XLA_FLAGS", "")  # restored after the test
    monkeypatch.setenv("PJRT_NPROC", "2")
    have = jax.device_count()  # this process's backend has started
    with pytest.raises(RuntimeError, match="XLA_FLAGS is read once per process"):
        devices.force_host_devices(have + 1)
