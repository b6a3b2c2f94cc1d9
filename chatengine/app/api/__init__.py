"""The OpenAI-compatible API under /v1."""
