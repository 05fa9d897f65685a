"""The OpenAI-compatible HTTP server (`jaxmamba serve`).

* `engine_loop`: the thread that owns the `LLMEngine` and steps it; handlers reach it only
  through its command queue, and it hands outputs back to asyncio queues.
* `protocol`: the request bodies (pydantic) and the OpenAI error shape.
* `metrics`: the Prometheus registry (`GET /metrics`).
* `api_server`: the FastAPI app, its routes, middleware and `run_server` (uvicorn).

Nothing here imports from the model: the server drives the engine through its public API.
"""
