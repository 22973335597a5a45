"""The one error a bad recipe config raises."""


class ConfigError(ValueError):
    """A bad recipe config; the message names the key by its dotted path."""
