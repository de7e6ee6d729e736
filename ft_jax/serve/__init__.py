"""`ft-jax serve`: the OpenAI-compatible HTTP server (needs the serve extra: fastapi, uvicorn, prometheus-client).
protocol.py (requests and answers), batcher.py (the continuous batcher thread over engine/batch.py's DecodeBatch),
metrics.py (Prometheus, the expert-cache view), app.py (the FastAPI routes); the command is ft_jax/cli/serve.py."""
