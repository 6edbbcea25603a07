"""jaxstable: keep low-precision JAX training finite.

Float32-safe losses (`jaxstable.losses`), loss scaling on jmp
(`jaxstable.loss_scale`), guarded optax transforms (`jaxstable.transforms`),
precision policies (`jaxstable.precision`), NaN diagnostics
(`jaxstable.diagnostics`) and a train step and loop (`jaxstable.train`).
This package never imports torch; its twin `torchref` never imports jax.
"""

from _stablecore import __version__ as __version__

# `pip install jaxstable` installs neither framework: each camp comes with its
# extra (CONTRIBUTING.md, "Packaging"). Name the extra when the camp is absent.
_CAMP = ("jax", "jaxlib", "flax", "optax", "orbax", "chex", "jmp", "numpy")

try:
    from jaxstable import diagnostics as diagnostics
    from jaxstable import loss_scale as loss_scale
    from jaxstable import losses as losses
    from jaxstable import precision as precision
    from jaxstable import train as train
    from jaxstable import transforms as transforms
except ModuleNotFoundError as err:
    if (err.name or "").split(".")[0] not in _CAMP:
        raise
    raise ModuleNotFoundError(
        f"jaxstable needs {err.name!r}, which is not installed: "
        'pip install "jaxstable[jax]" installs the JAX camp '
        "(jax, flax, optax, orbax-checkpoint, chex, jmp)",
        name=err.name,
    ) from err
