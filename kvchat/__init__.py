"""kvchat: a local chat app built around a paged, FP8, persistent KV cache."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The kernels live in the checkout's top-level ``kernels/`` folder and install as
# ``kvchat.kernels``. That folder has no ``__init__.py`` on purpose: a regular package named
# ``kernels`` at the checkout root would shadow Hugging Face's ``kernels`` package (which
# transformers imports) in every process whose ``sys.path`` holds the root — ``python -m
# pytest``, ``python -c``, ``python -m kvchat.cli`` run there. As a namespace package it is
# found through this package's ``__path__``: a wheel holds it inside ``kvchat/``; in a checkout
# (an editable install, whose finder does not resolve a namespace inside a regular package, or
# the checkout's ``kvchat/`` first on ``sys.path``) it lies beside ``kvchat/``, so the checkout
# root joins the search path, after ``kvchat/`` itself.
_here = _Path(__file__).resolve().parent
if not (_here / "kernels").is_dir() and (_here.parent / "kernels" / "dispatch.py").is_file():
    __path__.append(str(_here.parent))
