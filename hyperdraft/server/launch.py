"""Start the server: build the engine, start its thread, run uvicorn until SIGINT / SIGTERM, then stop cleanly."""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable

from hyperdraft.config import EngineArgs
from hyperdraft.server.options import ServeOptions, check_lossy, lossy_requested, served_model_name

logger = logging.getLogger("hyperdraft.server")

def serve(args: EngineArgs, opts: ServeOptions, output_hook: Callable[[str | None], None] | None = None) -> None:
    """output_hook: EngineLoop's (tests inject faults through it); the CLI passes none."""
    try:
        import uvicorn

        from hyperdraft.server.app import create_app
    except ImportError as e:
        raise ValueError(f"`hyperdraft serve` needs fastapi and uvicorn ({e}); install them with "
                         "pip install 'hyperdraft[serve]'") from None
    from hyperdraft.engine.engine import Engine
    from hyperdraft.engine.gc_policy import adopt_serving_policy
    from hyperdraft.server.engine_loop import EngineLoop
    from hyperdraft.server.generation import ServerContext
    from hyperdraft.server.metrics import ServerMetrics
    from hyperdraft.server.preprocess import Preprocessor

    check_lossy(lossy_requested(args), opts)  # before loading anything (the CLI has bound --host/--port once too)
    engine = Engine(args)
    lossy = engine.spec is not None and engine.spec.simulate_accept_rate is not None
    check_lossy(lossy, opts)
    adopt_serving_policy()  # this process serves this engine until it ends
    loop = EngineLoop(engine, opts.max_queued_requests, output_hook)
    preprocessor = Preprocessor(engine.tokenizer, opts.limits(engine.context_len), engine.context_len,
                                engine.model_config.vocab_size)
    ctx = ServerContext(loop, copy.deepcopy(engine.tokenizer), preprocessor, ServerMetrics(),
                        served_model_name(args, opts), engine.context_len, lossy or lossy_requested(args))
    app = create_app(ctx, opts)
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    print(f"hyperdraft: serving {ctx.model_name} at http://{opts.host}:{opts.port}"
          + (" (LOSSY BENCHMARK MODE)" if ctx.lossy else ""), file=sys.stderr, flush=True)
    # The app's lifespan starts and stops the engine thread. After a graceful shutdown on SIGTERM, uvicorn raises
    # the signal again, so the process ends as SIGTERM's default would (exit status -15 / 143).
    try:
        server.run()
    finally:
        loop.stop()  # normally a no-op: the lifespan already stopped it
