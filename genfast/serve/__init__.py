"""`genfast serve`: an OpenAI-compatible HTTP server over a continuous-batching engine.

engine (no HTTP dependency) is importable without the `serve` extra; app and commands need
FastAPI and uvicorn (pip install 'genfast[serve]').
"""
