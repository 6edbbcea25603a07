"""The other processes of a `jax.distributed` run, for `fit`: the same
settings on every process, and a failure on one ending them all."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

import jax

from jaxstable._src.distributed import all_processes
from jaxstable._src.fit_report import NonFiniteError


def check_same_on_every_process(**settings) -> None:
    """Refuses settings that differ between the processes of a
    `jax.distributed` run: their collectives (checkpoint gathers, rollbacks,
    the steps) would pair up wrongly, e.g. a checkpoint_dir on process 0
    only (the torch idiom) made both processes abort with a gloo
    "collective mismatch". One small all-gather."""
    mine = json.dumps(settings, sort_keys=True, default=repr).encode()
    every = [json.loads(raw) for raw in all_processes(mine)]
    for name in sorted(settings):
        values = [got[name] for got in every]
        if any(v != values[0] for v in values):
            each = ", ".join(f"process {i}: {v!r}" for i, v in enumerate(values))
            raise ValueError(
                f"fit under jax.distributed: every process must pass the same "
                f"{name}, got {each}. Checkpoints are saved and restored by all "
                "processes together: give checkpoint_dir (one shared directory) "
                "on every process; process 0 alone writes the log"
            )


class Peers:
    """The other processes of a `jax.distributed` run, for `fit`.

    When fit fails on one process only, the others would wait in the next
    step's collectives, and a process that ends would wait in jax's shutdown
    barrier (at exit) for the others: both end only when jax's heartbeat
    timeout aborts the process with SIGABRT (100 s by default). So a process
    whose fit fails (its own exception, or a collective that failed because
    another process died) writes a message to jax's key-value store, and a
    thread of every other process, polling it twice a second, prints it,
    answers and exits its process with status 1 (a thread cannot interrupt
    the main thread's collective). The failing process waits up to
    `ANSWER_S` for the answers: after a failed collective, the processes
    that did not answer are named in its error as the dead ones. Then it
    raises, and ends with status 1 when Python exits (`_end`), without
    jax's shutdown barrier, which cannot complete without the others.
    Process 0 ends last (each process says when it ends, and process 0
    waits up to `ANSWER_S` for the others, but those its own roll call
    found silent): its exit takes jax's coordination service down, and
    jaxlib then aborts every process still running, mid-message.

    What no Python can do: a dead process 0 takes the coordination service
    with it, and jaxlib ends every other process at once (its default
    ``missed_heartbeat_callback``, a fatal log: SIGABRT, "Terminating
    process because the JAX distributed service detected fatal errors").
    A collective that hangs instead of failing is ended the same way after
    the heartbeat timeout. With one process this class does nothing.
    """

    POLL_S = 0.5
    ANSWER_S = 2.0  # 4 polls: enough for a live process's thread to answer
    calls = 0  # fit calls so far: every process makes them in the same order

    def __init__(self):
        self.step: int | None = None
        self.client = None
        if jax.process_count() == 1:
            return
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        type(self).calls += 1
        self.prefix = f"jaxstable/fit/{type(self).calls}/"
        self.silent: list[int] = []  # named by this process's roll call
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _say(self, what: str, text: str | None = None) -> None:
        """Writes key `what`, holding `text` (the failure message: set once,
        the first wins), or ``what/<this process>`` without."""
        key = self.prefix + what
        if text is None:
            key, text = f"{key}/{jax.process_index()}", "1"
        try:
            self.client.key_value_set(key, text)
        except Exception:  # set already by another process, or the store is gone
            pass

    def _wait_for(self, what: str, skip=()) -> list[int]:
        """Waits up to `ANSWER_S` until every other process (but `skip`)
        has said `what`; those that have not, ascending."""
        others = set(range(jax.process_count())) - {jax.process_index(), *skip}
        deadline = time.monotonic() + self.ANSWER_S
        while True:
            try:
                got = self.client.key_value_dir_get(self.prefix + what + "/")
                missing = others - {int(k.rsplit("/", 1)[-1]) for k, _ in got}
            except Exception:  # the store is gone: process 0 died
                missing = others
            if not missing or time.monotonic() >= deadline:
                return sorted(missing)
            time.sleep(self.POLL_S / 5)

    def _watch(self) -> None:
        while not self.done.wait(self.POLL_S):
            try:
                message = self.client.key_value_try_get(self.prefix + "failed")
            except Exception:  # not there (yet): jax raises NOT_FOUND
                continue
            if self.done.is_set():
                return
            sys.stderr.write(
                f"jaxstable fit: {message}; process {jax.process_index()} "
                f"(at step {self.step}) stops too: it would wait for that "
                "process in the step's collectives\n"
            )
            sys.stderr.flush()
            self._say("alive")
            self._end()

    def _end(self) -> None:
        """Ends this process with status 1 (process 0 last, see above)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # closed or replaced by the user
                pass
        self._say("gone")
        if jax.process_index() == 0:
            self._wait_for("gone", skip=self.silent)
        os._exit(1)

    def failed(self, error: BaseException) -> str | None:
        """Tells the other processes that this one's fit failed with
        ``error``; the message of the RuntimeError to raise instead of it
        when another process did not answer (it died), or for a JAX runtime
        error (a failed collective), else None.

        Not a `NonFiniteError`: the guard's decisions are global, so every
        process raises it at the same step itself (and must not be ended by
        another's message first)."""
        if self.client is None:
            return None
        self.done.set()
        if isinstance(error, NonFiniteError):
            return None
        runtime = isinstance(error, jax.errors.JaxRuntimeError)
        where = "before its first step" if self.step is None else f"at step {self.step}"
        text = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        verb = "failed" if runtime else "raised"
        self._say("failed", f"process {jax.process_index()} {verb} {where}: {text}")
        self._say("alive")  # another failing process waits for it too
        self.silent = self._wait_for("alive")
        if not _ENDING:  # at exit, before jax's handler (the last runs first)
            _ENDING.append(self)
            atexit.register(self._end)
        # Not by type alone: a collective that fails in a gather to the host
        # (a checkpoint, a report) is a ValueError from jax, not a
        # JaxRuntimeError ("UNKNOWN: Gloo AllGather failed", jax 0.10.2).
        return self._message(error, runtime) if runtime or self.silent else None

    def _message(self, error: BaseException, runtime: bool) -> str:
        first = str(error).splitlines()[0][:300] if str(error) else ""
        what = (
            "a JAX runtime error, most likely a collective with the other "
            "processes that failed"
            if runtime
            else "an error"
        )
        head = (
            f"fit: process {jax.process_index()} at step {self.step}: {what} "
            f"({type(error).__name__}: {first}); "
        )
        if not self.silent:
            return head + (
                "every other process answered (none died): the error is this "
                "process's own. They stop too"
            )
        who = ", ".join(map(str, self.silent))
        return head + (
            f"process(es) {who} did not answer within {self.ANSWER_S:g} s: "
            "died (killed, out of memory, host lost) or hang. This process "
            "exits with status 1 when Python ends (jax's shutdown barrier "
            "cannot complete without them). Restart every process: "
            "fit(resume=True) goes on from the last checkpoint"
        )

    def stop(self) -> None:
        if self.client is not None:
            self.done.set()


# The `Peers` whose `_end` is registered with atexit (once a process).
# Registered after jax's exit handler, so it runs first: that handler calls
# jax.distributed.shutdown(), whose barrier waits for every process, and
# once one is gone it waits until the heartbeat timeout and jax aborts this
# process (SIGABRT). Handlers registered before this one are skipped.
_ENDING: list[Peers] = []
