"""The OpenAI-compatible HTTP server (`hyperdraft serve`).

- protocol.py: request models, validation, the OpenAI error shape;
- engine_loop.py: the one thread that owns the Engine, fed by a command queue;
- generation.py: one HTTP request's choices (detokenization, logprobs, SSE chunks);
- metrics.py: Prometheus counters, gauges and histograms, speculation included;
- app.py: the FastAPI routes; launch.py: building the engine and running uvicorn;
- options.py: the `serve` flags.

Only app.py and launch.py import fastapi / uvicorn (the `serve` extra), so `import hyperdraft` never needs them.
"""
