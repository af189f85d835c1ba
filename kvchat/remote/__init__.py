"""The TUI and ``kvchat ask`` on a model served elsewhere (``--server URL``): an OpenAI-compatible server.

- :mod:`.address`: a server's URL as recorded, and the plain-``http://`` warning (stdlib only).
- :mod:`.keys`: the API key, from an environment variable or the data dir's 0600 ``server-keys.toml``.
- :mod:`.client`: the HTTP side (models, ``/health`` counters, one streamed completion), errors as one line.
- :mod:`.chats`: the open chat kept in kvchat's SQLite store as text, its turns sent to the server.
- :mod:`.figures`: a turn's reuse as the server reports it, as a status line.

Nothing here imports torch.
"""
