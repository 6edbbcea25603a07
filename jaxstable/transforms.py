"""JAX: public API of `jaxstable.transforms` (implementation in `jaxstable._src.transforms`)."""
