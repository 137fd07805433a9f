"""Quality measurements through the public engine API (perplexity on a shipped text)."""
