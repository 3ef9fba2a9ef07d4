"""rlfuse.serve: the OpenAI-compatible HTTP server on the engine, and agents trained through it (the `serve` extra)."""

from rlfuse.serve.agents import AgentSampler, EngineBase, agent_sampler, open_agent_session
from rlfuse.serve.app import build_app
from rlfuse.serve.session import SessionStore, add_session_routes, serve_app
from rlfuse.serve.worker import EngineWorker

__all__ = ["AgentSampler", "EngineBase", "EngineWorker", "SessionStore", "add_session_routes", "agent_sampler", "build_app",
           "open_agent_session", "serve_app"]
