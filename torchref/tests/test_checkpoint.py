"""torchref checkpoints: what a checkpoint holds and how it is written
(issue 34 items 8 and 10)."""

import os
import threading

import torch

from torchref import train


def _step(value: float) -> train.TrainStep:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return train.TrainStep(model, opt, lambda m, b: m(b).sum())


def test_two_threads_saving_to_one_path_each_write_a_whole_file(tmp_path, monkeypatch):
    # The first thread's write pauses at its fsync while a second thread
    # saves to the same path. With a temporary name unique per process only,
    # the second truncated and renamed away the first's file: the first's
    # os.replace then raised FileNotFoundError.
    path = os.fspath(tmp_path / "ckpt.pt")
    real_fsync, paused, second_done = os.fsync, threading.Event(), threading.Event()

    def fsync(fd):
        if threading.current_thread().name == "first" and not paused.is_set():
            paused.set()
            second_done.wait(30)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    errors = []

    def first():
        try:
            train.save_checkpoint(path, _step(1.0))
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    thread = threading.Thread(target=first, name="first")
    thread.start()
    assert paused.wait(30)
    try:
        train.save_checkpoint(path, _step(2.0))
    finally:
        second_done.set()
        thread.join(30)
    assert errors == []
    # The first write renamed last: its file, whole.
    restored = train.load_checkpoint(path, _step(0.0))
    assert restored.model.weight.tolist() == [[1.0, 1.0]]
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_manager_removes_a_killed_writes_temporary_files(tmp_path):
    for name in ("step_00000004.pt.tmp-123", "step_00000004.pt.tmp-123-456-7"):
        (tmp_path / name).write_bytes(b"half")
    train.CheckpointManager(tmp_path)
    assert os.listdir(tmp_path) == []
