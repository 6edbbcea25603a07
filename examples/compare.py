"""Naive vs stable low-precision training, JAX and PyTorch side by side.

    python examples/compare.py --help            # lists the tasks
    python examples/compare.py segmentation --precision float16 --steps 400 \\
        --out runs/demo
    python examples/compare.py demo    # the same with the defaults (`make demo`)
    python examples/compare.py ocr --precision float16 --out runs/ocr
    python examples/compare.py contrastive --precision bfloat16 \\
        --out runs/contrastive
    python examples/compare.py detection --precision float16 --out runs/detection
    python examples/compare.py lm --out runs/lm    # bfloat16 by default
    python examples/compare.py segmentation --devices 2 --one-device-reference

For the task named, from the same initial weights (torch's seeded init,
converted to Flax NNX) and the same batches, trains six runs: JAX naive, JAX
stable, torch naive, torch stable at ``--precision``, and a float32 run of
each framework as the reference (with ``--precision float32`` the reference
is the stable run itself: four runs), each on the library's own ``fit``.
Writes ``metrics.jsonl``, ``summary.json``, ``curves.png`` and ``report.md``
into ``--out`` (see `examples/harness/`, which holds all of it; a task
folder holds only what is specific to it).

``--devices N`` (segmentation) trains every run data parallel: JAX on N
devices (N forced host CPU devices, set in ``XLA_FLAGS`` by
`examples.harness.devices.force_host_devices` after parsing and before JAX starts;
on GPUs the first N of them), torch in N DDP processes; see the README.

Nothing is injected: a naive run fails only if its arithmetic really
overflows or underflows.
"""

from __future__ import annotations

import importlib
import os
import sys

# Runnable as a script from the repository root: `python examples/compare.py`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples import harness  # noqa: E402

# name -> module defining TASK (an `examples.harness.parts.Task`)
TASKS = {
    "segmentation": "examples.segmentation.task",
    "ocr": "examples.ocr.task",
    "contrastive": "examples.contrastive.task",
    "detection": "examples.detection.task",
    "lm": "examples.lm.task",
}
DEMO = "segmentation"  # `compare.py demo` (`make demo`): its defaults


def tasks() -> dict:
    """The TASK objects by name.

    Example:
        >>> sorted(tasks())
        ['contrastive', 'detection', 'lm', 'ocr', 'segmentation']
    """
    return {name: importlib.import_module(mod).TASK for name, mod in TASKS.items()}


def parse_args(argv: list[str] | None = None):
    """The command line (see `examples.harness.parse_args`).

    Example:
        >>> a = parse_args(["segmentation", "--precision", "bfloat16", "--quick"])
        >>> a.name, a.precision, a.quick, a.out
        ('segmentation', 'bfloat16', True, 'runs/segmentation')
    """
    return harness.parse_args(tasks(), argv, demo=DEMO)


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints the table and where the report is."""
    return harness.main(tasks(), argv, demo=DEMO)


if __name__ == "__main__":
    sys.exit(main())
