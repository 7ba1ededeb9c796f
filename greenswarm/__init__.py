"""greenswarm: pretrain language models across independent sites on curtailed renewable electricity."""

__version__ = "0.1.0"
