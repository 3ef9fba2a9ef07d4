"""`rlfuse serve MODEL_OR_RUN`: an OpenAI-compatible HTTP server on the built-in engine.

    rlfuse serve runs/my_grpo --port 8000           # the run's final/ (else its latest checkpoint)
    rlfuse serve MODEL_DIR --numerics exact --host 0.0.0.0
then any OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`; a recorded
agent session (token-exact trajectory, rlfuse/serve/session.py) at base_url
`http://127.0.0.1:8000/sessions/ID/v1`, its record at GET /sessions/ID/trajectory.
Routes and request fields: rlfuse/serve/app.py, rlfuse/serve/protocol.py, docs/serving.md.
Needs the `serve` extra (pip install -e '.[serve]': fastapi, uvicorn).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlfuse.api import load_model
from rlfuse.cli.common import add_engine_arguments, engine_config, fail, setup_threads
from rlfuse.engine import LLM

HELP = "serve a model or run over an OpenAI-compatible HTTP API (completions, chat)"
log = logging.getLogger("rlfuse.cli")


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_OR_RUN",
                   help="HF model folder, checkpoint folder, or run folder (its final/, else its latest checkpoint)")
    p.add_argument("--adapter", default=None,
                   help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) applied "
                        "to MODEL, unmerged, as `rlfuse generate --adapter` does")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the folder's name)")
    add_engine_arguments(p)


def run(args) -> int:
    try:
        # optional dependencies (the `serve` extra): imported only by this command
        import uvicorn

        from rlfuse.serve import serve_app
    except ImportError as e:
        return fail(ValueError(f"rlfuse serve needs the serve extra ({e.name} is not installed): "
                               "pip install 'rlfuse[serve]'"))
    try:
        setup_threads(args.threads)
        cfg = engine_config(args)
        model, tok = load_model(args.model, device=args.device or "auto", dtype=args.dtype,
                                device_option="--device", adapter=args.adapter or None)
        name = args.served_model_name or Path(args.model).resolve().name
        app = serve_app(LLM(model, tok, cfg), name)  # with the recorded agent sessions' routes
    except ValueError as e:
        return fail(e)
    print(f"rlfuse serve: {name} on http://{args.host}:{args.port}/v1 (numerics {cfg.numerics})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=logging.getLevelName(log.getEffectiveLevel()).lower())
    return 0
