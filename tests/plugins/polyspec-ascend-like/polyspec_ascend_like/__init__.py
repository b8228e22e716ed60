"""Registers polyspec's Ascend-shaped constrained test backend (``ascend-like``)."""
