"""`edgellm serve [MODEL]`: an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions,
/v1/models, /health, /metrics, /tokenize, /detokenize). It listens at once; /health says 503 until
the model is loaded, then the URL and the plan are printed."""
from __future__ import annotations

import argparse
import socket
import sys
import threading

from edgellm.commands.flags import add_model_arguments, add_spec_arguments, placement_kwargs, spec_kwargs
from edgellm.errors import EdgeLLMError, InvalidArgumentError

KV_TYPES = ("f16", "f32", "q8_0", "q4_0")


class ServerError(EdgeLLMError):
    """The server cannot start (missing extra, address in use)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port)")
    p.add_argument("-np", "--parallel", type=int, default=4, metavar="N",
                   help="sequences generated at once (default 4)")
    p.add_argument("--queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a sequence; more get 503 (default 64)")
    p.add_argument("--kv-size", type=int, default=None, metavar="N",
                   help="KV cache pool in tokens, shared by the sequences (default: -np x -c)")
    p.add_argument("-b", "--batch", type=int, default=512, metavar="N", help="prompt batch size (default 512)")
    p.add_argument("-ctk", "--cache-type-k", choices=KV_TYPES, default="f16", metavar="TYPE",
                   help=f"KV cache type: {', '.join(KV_TYPES)} (default f16)")
    p.add_argument("-ctv", "--cache-type-v", choices=KV_TYPES, default=None, metavar="TYPE",
                   help="KV cache type of V; must equal -ctk (one type for both)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--alias", default=None, metavar="NAME", help="model name for clients (default: the file's stem)")
    p.add_argument("--vram", default=None, metavar="SIZE", help="GPU memory budget for --gpu-layers auto")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on Ctrl+C / SIGTERM, running requests get S seconds to finish, then they are "
                        "ended (default 10)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every request gets the tokens it gets alone, whatever else runs (slower with 8+ "
                        "sequences of a K-quant file)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    add_spec_arguments(p)


def _check(args) -> None:
    if args.cache_type_v is not None and args.cache_type_v != args.cache_type_k:
        raise InvalidArgumentError("-ctk and -ctv must name the same type (the KV cache has one element type)")
    for flag, v, lo in (("--parallel", args.parallel, 1), ("--queue", args.queue, 0), ("--ctx", args.ctx, 1),
                        ("--port", args.port, 0), ("--kv-size", args.kv_size or 1, 1),
                        ("--shutdown-timeout", args.shutdown_timeout, 0)):
        if v < lo:
            raise InvalidArgumentError(f"{flag} must be >= {lo}, got {v}")
    if args.port > 65535:
        raise InvalidArgumentError(f"--port must be <= 65535, got {args.port}")
    args.spec = {**spec_kwargs(args), **placement_kwargs(args)}


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _graceful(server_class, engine, grace: float):
    """uvicorn's Server, stopping the way `edgellm serve` promises on SIGINT / SIGTERM: stop
    accepting, give running requests `grace` seconds, end the rest with a message to their clients
    (before uvicorn's own wait, which would cancel their tasks with a traceback), exit code 0 (after
    its graceful shutdown uvicorn raises the caught signal again: exit 130 / -15)."""

    class Server(server_class):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

        async def shutdown(self, sockets=None) -> None:
            for server in getattr(self, "servers", []):
                server.close()  # no new connections while the running requests finish
            for sock in sockets or []:
                sock.close()
            if engine.streams:
                print(f"edgellm serve: stopping; {len(engine.streams)} running request(s) get up to "
                      f"{grace:g} s to finish (Ctrl+C again: end them now)", file=sys.stderr, flush=True)
            ended = await engine.drain(grace, give_up=lambda: self.force_exit)
            if ended:
                print(f"edgellm serve: ended {ended} request(s) still running", file=sys.stderr, flush=True)
            self.force_exit = False  # the requests are over: let uvicorn close the connections normally
            await super().shutdown(sockets)

    return Server


def run(args) -> int:
    _check(args)
    try:
        import uvicorn
        from edgellm.serve.app import Server, build_app
    except ImportError as exc:
        raise ServerError(f"the server needs the 'server' extra ({exc.name} is missing): "
                          "pip install 'edgellm[server]'") from None
    import edgellm
    from edgellm.fetch import resolve_model
    from edgellm.serve.host import ModelHost

    path = resolve_model(args.model, quiet=False)  # a first-use download shows its progress here
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]

    def load():
        return edgellm.load(path, gpu_layers=args.gpu_layers, n_ctx=args.ctx, n_batch=args.batch,
                            threads=args.threads, vram=args.vram, kv_type=args.cache_type_k, n_seq=args.parallel,
                            kv_size=args.kv_size, quiet=False, use_mmap=args.use_mmap, flash_attn=args.flash_attn,
                            batch_invariant=args.batch_invariant, **args.spec)

    engine = ModelHost(load, queue=args.queue)
    server = Server(engine, model_path=path, alias=args.alias, api_key=args.api_key)
    config = uvicorn.Config(build_app(server), log_level="info" if args.verbose else "warning",
                            access_log=args.verbose, timeout_graceful_shutdown=10, lifespan="off")
    userver = _graceful(uvicorn.Server, engine, args.shutdown_timeout)(config)
    shown = "[" + host + "]" if ":" in host else host
    print(f"edgellm serve: loading {path.name}; listening on http://{shown}:{port} (/health is 503 until loaded)",
          file=sys.stderr, flush=True)

    def when_loaded():
        engine.ready.wait()
        if engine.load_error is not None:
            userver.should_exit = True
            return
        _print_ready(engine.model, server, f"http://{shown}:{port}", args)

    engine.start()
    threading.Thread(target=when_loaded, name="edgellm-ready", daemon=True).start()
    userver.run(sockets=[sock])
    if engine.load_error is not None:
        raise engine.load_error
    close = getattr(engine.model, "close", None)
    if close is not None:
        close()
    print("edgellm serve: stopped", file=sys.stderr, flush=True)
    return 0


def _print_ready(model, server, url: str, args) -> None:
    from edgellm.commands.run import print_plan

    out = sys.stdout
    print_plan(model, out)
    s = model.engine_stats()
    print(f"slots: {s.get('n_seq')} sequences, n_ctx {model.n_ctx}, KV blocks {s.get('kv_blocks_total')}, "
          f"queue {args.queue}", file=out)
    print(f"model '{server.name}' ready: {url}/v1 (OpenAI API), {url}/health, {url}/metrics"
          + (" (API key required)" if args.api_key else ""), file=out, flush=True)
