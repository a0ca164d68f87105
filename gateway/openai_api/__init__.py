"""The gateway's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the gateway's own process and event loop)."""
