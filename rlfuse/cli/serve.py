"""`rlfuse serve MODEL_OR_RUN`: an OpenAI-compatible HTTP server on the built-in engine.

    rlfuse serve runs/my_grpo --port 8000           # the run's final/ (else its latest checkpoint)
    rlfuse serve MODEL_DIR --numerics exact --host 0.0.0.0
    rlfuse serve MODEL_DIR --lora math=adapters/math code=adapters/code   # several adapters, one batch
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
from rlfuse.model.lora_bank import load_adapter_bank

HELP = "serve a model or run over an OpenAI-compatible HTTP API (completions, chat)"
log = logging.getLogger("rlfuse.cli")


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_OR_RUN",
                   help="HF model folder, checkpoint folder, or run folder (its final/, else its latest checkpoint)")
    p.add_argument("--adapter", default=None,
                   help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) applied "
                        "to MODEL, unmerged, as `rlfuse generate --adapter` does")
    p.add_argument("--lora", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT LoRA adapter folders served beside MODEL, all at once: a request whose `model` is "
                        "NAME runs under that adapter, one naming the model runs the base; requests for different "
                        "adapters share batches (the adapters must share rank and targets)")
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
        loras = _lora_args(args.lora or [])
        if loras and args.adapter:
            raise ValueError("rlfuse serve: --adapter applies one adapter to the model itself; --lora serves several "
                             "beside the base: give one of them")
        model, tok = load_model(args.model, device=args.device or "auto", dtype=args.dtype,
                                device_option="--device", adapter=args.adapter or None)
        if loras:
            load_adapter_bank(model, loras)
        name = args.served_model_name or Path(args.model).resolve().name
        app = serve_app(LLM(model, tok, cfg), name)  # with the recorded agent sessions' routes
    except ValueError as e:
        return fail(e)
    also = f" and adapters {', '.join(loras)}" if loras else ""
    print(f"rlfuse serve: {name}{also} on http://{args.host}:{args.port}/v1 (numerics {cfg.numerics})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=logging.getLevelName(log.getEffectiveLevel()).lower())
    return 0


def _lora_args(items: list[str]) -> dict[str, str]:
    """--lora NAME=PATH ... -> {name: path}, in order."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"rlfuse serve --lora: expected NAME=PATH (e.g. math=adapters/math), got {item!r}")
        if name in out:
            raise ValueError(f"rlfuse serve --lora: the name {name!r} is given twice")
        out[name] = path
    return out
