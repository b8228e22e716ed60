"""Kernels only: the PyTorch reference of every KernelSet entry (the oracle,
:func:`polyspec.kernels.reference.reference_kernels`), weight quantization, and portable Triton
versions. Kernels implement the contract's signatures and import no backend."""
