"""The segmentation task's committed void-image run
(`examples/segmentation/bad_data.py`, `examples/segmentation/results/bad_data.json`)
holds what its README and report claim: a dropped micro-batch counted, the
all-void batch listed in ``bad_batches.json`` and skipped on the restart,
in both frameworks; relations between the records, not their digits. No
training here: the runs belong to the example's CLI.
"""

import json
import os

import numpy as np
import pytest

from examples.harness import report
from examples.harness.results import RunResult
from examples.segmentation import bad_data
from examples.segmentation.task import TASK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "examples", "segmentation", "results")
FRAMEWORKS = ("jax", "torch")


@pytest.fixture(scope="module")
def data():
    with open(os.path.join(RESULTS, "bad_data.json"), encoding="utf-8") as f:
        return json.load(f)


def _void(data):
    return {int(p): images for p, images in data["void"].items()}


def test_the_bad_records_are_void_labels_not_injected_nans(data):
    config = TASK.get_config(**data["config"])
    batches = bad_data.void_batches(config)
    drawn = TASK.train_batches(config)
    for position, (made, original) in enumerate(zip(batches, drawn, strict=True)):
        # the images are the generator's, finite; only labels changed
        assert np.all(np.isfinite(made["image"]))
        np.testing.assert_array_equal(made["image"], original["image"])
        labelled = (made["label"] != 255).sum(axis=(1, 2))
        void = _void(data).get(position, [])
        assert [i for i in range(len(labelled)) if labelled[i] == 0] == void
        for i in range(len(labelled)):
            if i not in void:
                np.testing.assert_array_equal(made["label"][i], original["label"][i])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_micro_batch_dropped_the_batch_listed_and_skipped_on_restart(data, fw):
    run = data["frameworks"][fw]
    first = run["first_call"]["records"]
    size = data["config"]["batch_size"]
    void = _void(data)
    partly = [p for p, images in void.items() if len(images) < size]
    wholly = [p for p, images in void.items() if len(images) == size]
    # (a) the batch with one void image: its micro-batch dropped, the step
    # went on with the valid ones (finite, applied)
    for p in partly:
        rec = first[p]
        assert rec["step"] == p and rec["finite"] is True
        assert rec["microbatches_dropped"] == len(void[p]) >= 1
    # the other steps before the stop dropped nothing
    assert all(r["microbatches_dropped"] == 0 for r in first if r["step"] not in void)
    # (b) the all-void batch: no valid micro-batch, the step non-finite,
    # reproduced on the re-run, listed, and the run stopped there
    (p,) = wholly
    assert run["first_call"]["stopped_at"] == p == first[-1]["step"]
    bad = first[-1]
    assert bad["finite"] is False and bad["microbatches_dropped"] == size
    assert bad["reproduced"] is True and bad["bad_batches_listed"] == [p]
    listed = run["bad_batches_json"]["batches"]
    assert [b["position"] for b in listed] == [p]
    assert listed[0]["reason"] == "reproduced"
    # the restart resumed from the checkpoint at p, skipped p without running
    # it (no record of step p) and said so in the next step's record
    restart = run["restart"]["records"]
    steps = [r["step"] for r in restart]
    assert steps == list(range(p + 1, data["config"]["steps"]))
    assert restart[0]["bad_batches_skipped"] == [p]
    assert all("bad_batches_skipped" not in r for r in restart[1:])
    assert all(r["finite"] for r in restart)
    assert run["equal_to_run_without_listed"] is True


def test_the_frameworks_write_the_same_records(data):
    jax_run, torch_run = (data["frameworks"][fw] for fw in FRAMEWORKS)
    for call in ("first_call", "restart"):
        a, b = jax_run[call]["records"], torch_run[call]["records"]
        assert [{k: v for k, v in r.items() if k != "loss"} for r in a] == [
            {k: v for k, v in r.items() if k != "loss"} for r in b
        ]
    assert jax_run["bad_batches_json"] == torch_run["bad_batches_json"]
    assert bad_data.loss_gap(data) < 1e-4


def test_the_readme_and_the_report_show_the_committed_run(data):
    readme = os.path.join(ROOT, "examples", "segmentation", "README.md")
    with open(readme, encoding="utf-8") as f:
        assert "results/bad_data.json" in f.read()
    with open(os.path.join(RESULTS, "report.md"), encoding="utf-8") as f:
        text = f.read()
    section = bad_data.report_section(RESULTS)
    assert section == bad_data.section(data)
    marked = f"<!-- section segmentation -->\n{section.rstrip()}\n"
    assert marked + "<!-- end section segmentation -->" in text


def test_write_report_appends_the_task_section(tmp_path, data):
    (tmp_path / "bad_data.json").write_text(json.dumps(data))
    cfg = TASK.get_config(steps=2)
    run = RunResult("jax", cfg, [{"loss": 1.0}] * 2, None, 1.0, 0, {}, 1.0)
    run.scores = {k: 1.0 for k in TASK.metrics}
    summary = {"task": "segmentation", "precision": "float16", "wall_time_s": 1.0}
    path = report.write_report(TASK, str(tmp_path), [run], summary, "cmd")
    with open(path, encoding="utf-8") as f:
        assert bad_data.section(data).rstrip() in f.read()
    os.remove(tmp_path / "bad_data.json")
    report.write_report(TASK, str(tmp_path), [run], summary, "cmd")
    assert "<!-- section segmentation -->" not in (tmp_path / "report.md").read_text()
