"""The killed run of `parity_tests/test_fit_chance.py`'s kill-and-resume
test: ``python -m parity_tests.bad_data_worker FRAMEWORK DIR`` trains over
`DATA` (a NaN in batch `BAD`) with a checkpoint every `EVERY` steps in DIR
and SIGKILLs its own process in the ``on_step`` of step `KILL_AT`: after
the NaN was located and listed in DIR/bad_batches.json, before the next
checkpoint. The test resumes it in its own process."""

from __future__ import annotations

import os
import signal
import sys

BAD, EVERY, KILL_AT, N = 4, 3, 5, 9


def kill_at(rec, state) -> None:
    del state
    if rec["step"] == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)


def main(framework: str, folder: str) -> None:
    from parity_tests.test_fit_chance import _data, _fit
    from torchref import train

    ckpt = train.Checkpointing(folder, every=EVERY, resume=True, skip_listed=True)
    _fit(framework, _data(N, nan_at=[BAD]), checkpoint=ckpt, on_step=kill_at)
    raise SystemExit("the run was not killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
