"""The ``kvchat`` command: one module per sub-command (printing only; the work is elsewhere).

:mod:`.main` parses arguments and dispatches; :mod:`.ask`, :mod:`.cache` (``cache`` and ``doc``),
:mod:`.model` (``model pull|list``).
"""
