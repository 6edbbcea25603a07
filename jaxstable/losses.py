"""JAX: public API of `jaxstable.losses` (implementation in `jaxstable._src.losses`)."""
