"""The framework versions an integration runs with: each hooks internals checked for a version range only."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def check_version(package: str, supported: tuple[tuple[int, int], tuple[int, int]], integration: str,
                  install: str) -> str:
    """The installed version of `package`; ImportError when it is missing or outside `supported`, a
    [lower, upper) pair of (major, minor), naming `integration` and the `install` command."""
    try:
        installed = version(package)
    except PackageNotFoundError:
        raise ImportError(f"rollout_service.integrations.{integration} needs {package}: {install}") from None
    parts = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    lo, hi = supported
    if not lo <= parts < hi:
        raise ImportError(f"rollout_service.integrations.{integration} supports {package} >= "
                          f"{'.'.join(map(str, lo))}, < {'.'.join(map(str, hi))} (it relies on {package} internals "
                          f"checked for those versions); found {package} {installed}: {install}")
    return installed
