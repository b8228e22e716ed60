"""``polyspec serve``: an OpenAI-compatible HTTP server over the engine loop.

Layers (DESIGN.md section 6): serve -> engine; nothing below imports this package. The modules:

- :mod:`~polyspec.serve.api_errors`: OpenAI-style error bodies and their HTTP statuses;
- :mod:`~polyspec.serve.protocol`: request validation (wire fields -> prompts and
  :class:`~polyspec.config.SamplingParams`) and the response / chunk bodies;
- :mod:`~polyspec.serve.responses`: ASGI responses that watch for a client disconnect
  (server-sent events, and JSON computed while the client waits);
- :mod:`~polyspec.serve.metrics`: the Prometheus registry of one server;
- :mod:`~polyspec.serve.app`: the FastAPI application;
- :mod:`~polyspec.serve.server`: uvicorn, model loading after the port is bound, SIGTERM;
- :mod:`~polyspec.serve.bench`: the serving benchmark's client (``polyspec bench-serve``).

FastAPI, uvicorn and prometheus-client come with the ``serve`` extra
(``pip install 'polyspec[serve]'``); only these modules import them.
"""
