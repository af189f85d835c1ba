"""The kvchat terminal UI (Textual): ``kvchat`` with no sub-command opens it.

The UI talks to the engine only through :mod:`kvchat.tui.backend`; importing
this package imports neither torch nor transformers.
"""
