"""JAX: public API of `jaxstable.loss_scale` (implementation in `jaxstable._src.loss_scale`)."""
