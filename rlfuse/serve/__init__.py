"""The OpenAI-compatible HTTP server on the engine (`rlfuse serve`). Reserved: nothing
here yet."""
