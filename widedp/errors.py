"""User-facing errors: the CLI prints their one-line message and exits 2 (no traceback)."""


class ConfigError(ValueError):
    """Bad input: a config key, a value, a file. The message names it in one line."""
