"""`k3x serve`: an OpenAI-compatible HTTP server over the serving runtime (runtime/engine_loop.py)."""
