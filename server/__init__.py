"""The OpenAI-compatible HTTP server (python -m server)."""
import pyengine  # noqa: F401  (first: it sets the OpenMP spin policy before torch loads)
