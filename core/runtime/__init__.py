"""Turns a batch of requests into tensors and runs one model through the backend."""
