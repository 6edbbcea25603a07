"""PyTorch: public API of `torchref.train` (implementation in `torchref._src.train`)."""
