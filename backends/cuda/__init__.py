"""CUDA backend (NVIDIA GPUs): Triton kernels, CUDA graphs. Importing this package imports no
CUDA or Triton code; ``backend.py`` does, and is imported only when the backend is created."""
