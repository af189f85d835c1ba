"""Benchmarks (``kvchat bench ...``) and the fault-injection drivers that share their child processes."""

import sys

# How a benchmark starts a child interpreter. ``-P`` keeps the working directory off sys.path, so a
# child started inside the source checkout imports the installed kvchat (which maps kernels/ and
# store/ into it), not the bare ./kvchat folder.
PYTHON = (sys.executable, "-P")
