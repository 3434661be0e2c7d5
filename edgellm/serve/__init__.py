"""`edgellm serve`: an OpenAI-compatible HTTP server on the many-sequence engine.

protocol.py (request checks, response shapes) → engine.py (the model on its threads, bridged to the
event loop) → metrics.py (Prometheus text) → app.py (Starlette routes). Needs the `server` extra
(starlette, uvicorn): `pip install 'edgellm[server]'`.
"""
