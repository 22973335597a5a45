"""verl's plugin entry point and the hooks it installs.

`load` is this package's `verl.plugins` entry point (pyproject.toml), which verl calls at the end of every
`import verl`, before any of verl's workers or trainers are imported. The hooks go in as each verl module they
change is imported (a finder on sys.meta_path), so loading the plugin imports nothing of verl's, and a verl run
that does not turn zero KL on pays for nothing but the check each hook makes of its model config.
"""
from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys

logger = logging.getLogger(__name__)


def _hooks() -> dict:
    """verl module -> the function that installs our hook in it (called with the module, once)."""
    from . import actor, driver, rollout
    return {
        "verl.utils.config": driver.install,
        "verl.workers.engine.fsdp.transformer_impl": actor.install,
        "verl.workers.rollout.vllm_rollout.vllm_async_server": rollout.install,
    }


ENTRY_POINT = f"{__name__}:load"  # pyproject.toml's verl.plugins entry


def load() -> None:
    """The `verl.plugins` entry point."""
    install()


def install() -> None:
    """Idempotent: hooks the verl modules already imported now, the others as they are imported."""
    for name, hook in _hooks().items():
        module = sys.modules.get(name)
        if module is not None:
            _apply(module, hook)
    if not any(isinstance(finder, _HookFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HookFinder())


def installed(module) -> bool:
    """Whether our hook is in `module` (one of _hooks()'s verl modules)."""
    return bool(getattr(module, "_zerokl_hooked", False))


def _apply(module, hook) -> None:
    """Runs `hook` on `module` once. A verl whose module lacks what the hook wraps (another release) keeps its
    module as it is, so that installing this package never breaks a verl run that does not turn zero KL on;
    one that does is stopped by config.check_verl_version."""
    if installed(module) or getattr(module, "_zerokl_hook_error", None):
        return
    try:
        hook(module)
    except AttributeError as error:
        module._zerokl_hook_error = repr(error)
        logger.warning("zero KL's hook for %s not installed (%r): this verl release is not one it supports",
                       module.__name__, error)
        return
    module._zerokl_hooked = True


class _HookFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a hooked verl module it asks the finders after it and wraps the loader, so
    that the hook runs right after the module's own code."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("verl."):
            return None
        hook = _hooks().get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookLoader(spec.loader, hook)
                return spec
        return None


class _HookLoader(importlib.abc.Loader):
    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _apply(module, self.hook)

    def __getattr__(self, name):  # get_source, get_code, ...: the wrapped loader's
        return getattr(self.loader, name)
