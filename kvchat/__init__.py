"""kvchat: a local chat app built around a paged, FP8, persistent KV cache."""

__version__ = "0.1.0"
