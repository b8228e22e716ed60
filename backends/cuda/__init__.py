"""CUDA backend (NVIDIA GPUs). The plugin is registered now; the backend comes in a later release."""
