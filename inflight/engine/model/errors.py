"""The one error a checkpoint that cannot be loaded raises."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A checkpoint folder cannot be loaded: the message names the file, what is wrong and what to do."""
