"""``polyspec bench``: throughput and acceptance of plain decoding, speculative decoding and a
Hugging Face ``transformers`` baseline on the same prompts.

One job per module: :mod:`~polyspec.bench.datasets` (prompt sets), :mod:`~polyspec.bench.metrics`
(acceptance and phase statistics), :mod:`~polyspec.bench.runner` (timing a polyspec engine),
:mod:`~polyspec.bench.hf_baseline` (timing ``transformers.generate``),
:mod:`~polyspec.bench.report` (JSON / text / markdown) and :mod:`~polyspec.bench.plot` (PNG).
"""
