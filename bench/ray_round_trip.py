"""Ray actor-call round trips on this machine, the floor under a weight push's calls (the sender to
the pool, the pool to each worker: two each for begin and finish); prints JSON.

    python -m bench.ray_round_trip --calls 100

Medians, in milliseconds, of a call to an async actor method that returns at once: from the driver,
from a threaded actor (as a trainer rank calls the pool) and from an async actor (as the pool calls a
worker), with no argument and with a 33 KB one (a push plan's size at Qwen2.5-1.5B's 339 tensors);
a call whose result carries an actor handle (the pool's begin returns its workers' for ipc); and a
push plan of 339 tensors as the object Ray pickles and as its wire form (SyncPlan.to_wire), in turns.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

PLAN_BYTES = 33_000
PLAN_TENSORS = 339  # Qwen2.5-1.5B's state dict


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100, help="calls per figure")
    args = ap.parse_args()

    import ray

    @ray.remote
    class Echo:
        async def echo(self, payload):
            return None

        async def handle(self, handles):
            return handles

    @ray.remote
    class ThreadedCaller:
        def run(self, target, payload, n: int) -> list[float]:
            times = []
            for _ in range(n):
                start = time.perf_counter()
                ray.get(target.echo.remote(payload))
                times.append(time.perf_counter() - start)
            return times

    @ray.remote
    class AsyncCaller:
        async def run(self, target, payload, n: int) -> list[float]:
            times = []
            for _ in range(n):
                start = time.perf_counter()
                await target.echo.remote(payload)
                times.append(time.perf_counter() - start)
            return times

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        echo, other = Echo.remote(), Echo.remote()
        threaded, asynchronous = ThreadedCaller.remote(), AsyncCaller.remote()
        ray.get([echo.echo.remote(None), threaded.run.remote(echo, None, 1), asynchronous.run.remote(echo, None, 1)])
        out = {}
        for size in (0, PLAN_BYTES):
            payload = b"x" * size
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                ray.get(echo.echo.remote(payload))
                times.append(time.perf_counter() - start)
            out[f"driver->async actor {size}B ms"] = _median_ms(times)
            out[f"sync actor->async actor {size}B ms"] = _median_ms(
                ray.get(threaded.run.remote(echo, payload, args.calls)))
            out[f"async actor->async actor {size}B ms"] = _median_ms(
                ray.get(asynchronous.run.remote(echo, payload, args.calls)))
        times = []
        for _ in range(max(1, args.calls // 2)):
            start = time.perf_counter()
            ray.get(echo.handle.remote([other]))
            times.append(time.perf_counter() - start)
        out["driver->actor returning a handle ms"] = _median_ms(times)
        plan = _plan()
        as_object, as_wire = [], []
        for _ in range(args.calls):  # in turns
            for times, payload in ((as_object, plan), (as_wire, plan.to_wire())):
                start = time.perf_counter()
                ray.get(echo.echo.remote(payload))
                times.append(time.perf_counter() - start)
        out["driver->async actor, a push plan as an object ms"] = _median_ms(as_object)
        out["driver->async actor, a push plan as its wire form ms"] = _median_ms(as_wire)
        print(json.dumps(out))
    finally:
        ray.shutdown()


def _plan():
    """A push plan of PLAN_TENSORS tensors with random fingerprints (the sizes do not matter here)."""
    import random

    from rollout_service.service.weight_sync import SyncPlan
    shapes = {f"model.layers.{i // 12}.weight_{i % 12}": (1536, 1536) for i in range(PLAN_TENSORS)}
    prints = {name: (random.getrandbits(62), random.getrandbits(62)) for name in shapes}
    return SyncPlan("broadcast", "digest", shapes, prints, 256 << 20, "cuda")


if __name__ == "__main__":
    main()
