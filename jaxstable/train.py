"""JAX: public API of `jaxstable.train` (implementation in `jaxstable._src.train`)."""
