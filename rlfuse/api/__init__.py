"""rlfuse.api: the Python API (scripts, notebooks), the layer the command line and the server stand on."""

from rlfuse.api.models import load_model, resolve_model_folder

__all__ = ["load_model", "resolve_model_folder"]
