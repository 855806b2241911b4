"""Tokenization's error type and the input checks shared by its modules (pure)."""
from __future__ import annotations

from typing import Any

__all__ = ["TokenizationError", "as_text", "check_unicode"]


class TokenizationError(ValueError):
    """Bad input for tokenization (the gateway answers HTTP 400)."""


def as_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TokenizationError(f"{what} must be a string, got {type(value).__name__}")
    return value


def check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizationError(
            f"text is not valid Unicode (lone surrogate at position {e.start}); it cannot be tokenized"
        ) from None
