"""The driver's check: verl's own config validation also runs config.check_config."""
from __future__ import annotations

import functools

from .config import check_config


def install(module) -> None:
    """Wraps verl.utils.config.validate_config (called by verl's PPO main with the whole config, before any
    worker starts), so an unsupported setting fails there with every problem listed."""
    original = module.validate_config

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        result = original(config, *args, **kwargs)
        check_config(config)
        return result

    module.validate_config = validate_config
