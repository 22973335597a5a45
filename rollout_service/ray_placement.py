"""Placement groups on Ray's cluster: reserving bundles, putting an actor on one, releasing them.

Below both the engine's tensor-parallel groups (engine/tp) and the service's workers, which place
their actors with these. Ray is imported inside the functions: `import rollout_service` works without it.
"""
from __future__ import annotations


def reserve(bundles: list[dict], strategy: str = "PACK"):
    """A placement group of `bundles` (not waited for: `ray.get(pg.ready())` or `await pg.ready()`)."""
    from ray.util.placement_group import placement_group
    return placement_group(bundles, strategy=strategy)


def on_bundle(placement, index: int, capture_child_tasks: bool = False):
    """The scheduling strategy that puts an actor on bundle `index` of `placement`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=capture_child_tasks)


def release(placement) -> None:
    from ray.util.placement_group import remove_placement_group
    remove_placement_group(placement)
