"""The OpenAI-compatible HTTP server (`kvflow serve`)."""
