"""weft: plugin-based parallelism for training vision-language models on long sequences."""

__version__ = "0.1.0"
