"""PyTorch: public API of `torchref.diagnostics` (implementation in `torchref._src.diagnostics`)."""
