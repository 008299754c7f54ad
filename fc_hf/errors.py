"""Errors FlexiCache raises; each message says what was wrong and how to fix it."""


class FlexiCacheError(RuntimeError):
    """A FlexiCache misuse that would otherwise produce wrong attention."""


class ProfileError(ValueError):
    """A head profile that cannot be read or does not match the model."""
