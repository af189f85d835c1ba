"""``kvchat serve``: an OpenAI-compatible HTTP server over the conversation service, with batched decode."""
