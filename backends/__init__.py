"""Backend plugins shipped with polyspec (cpu, cuda, npu), and ``common``, the mechanism they
share (no backend imports another)."""
