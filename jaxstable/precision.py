"""JAX: public API of `jaxstable.precision` (implementation in `jaxstable._src.precision`)."""
