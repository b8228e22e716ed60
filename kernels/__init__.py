"""Kernels: the PyTorch reference (the oracle) and portable Triton versions."""
