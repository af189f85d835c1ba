"""``python -m kvchat.cli``: the ``kvchat`` command."""

import sys

from kvchat.cli.main import main

sys.exit(main())
