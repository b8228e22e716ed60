"""Backend plugins shipped with polyspec (cpu, cuda, npu)."""
