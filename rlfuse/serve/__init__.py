"""rlfuse.serve: the OpenAI-compatible HTTP server on the engine (needs the `serve` extra: fastapi, uvicorn)."""

from rlfuse.serve.app import build_app
from rlfuse.serve.worker import EngineWorker

__all__ = ["EngineWorker", "build_app"]
