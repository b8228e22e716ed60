"""Requests, the continuous-batching scheduler and the ``LLM`` facade."""
