"""A chat's whole life on top of the engine and the store, for every front-end (CLI, TUI, server).

- :mod:`.service`: :class:`~.service.ChatService`, the loaded runtime and its
  one open chat: new, open (restore), send (streaming), regenerate, edit the
  last message, continue in a new chat, attach documents.
- :mod:`.listing`: the store-side operations (list, rename, pin, delete,
  purge, cache report), callable before the model is loaded (they import
  torch, not the model).
- :mod:`.records`: a session to and from its stored conversation.
- :mod:`.rewind`: turn spans and carrying turns into a new chat.
- :mod:`.continuation`: what a full chat can carry into a new one (torch-free arithmetic and its lines).
- :mod:`.views`, :mod:`.events`, :mod:`.streaming`: the plain, torch-free
  dataclasses and events the front-ends receive.

Importing this package imports nothing heavy; :mod:`.service` and
:mod:`.listing` import torch; :mod:`.views` and :mod:`.events` stay torch-free.
"""
