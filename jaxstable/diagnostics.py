"""JAX: public API of `jaxstable.diagnostics` (implementation in `jaxstable._src.diagnostics`)."""
