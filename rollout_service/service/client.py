"""RolloutClient: what a training loop calls, from any driver or job in the Ray cluster.

Rule (a pool that restarts): a call that fails because the pool's actor is restarting
(ActorUnavailableError: start_pool(max_restarts=...)) is made again once it is back, for at most
restart_wait_s; requests keep their ids and, outputs being a pure function of the request, their bits.
A pool that died for good (ActorDiedError) is said at once.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import ray
from ray.exceptions import ActorUnavailableError, RayTaskError

from rollout_service.params import Rollout, SamplingParams, check_batch
from rollout_service.service.ray_cluster import init_ray, original_error
from rollout_service.service.weight_sync import DEFAULT_BUCKET_BYTES, DEFAULT_STAGE_BYTES, WeightPush

# Named actors are per namespace; a fixed one lets every job in the cluster find the pool.
DEFAULT_NAMESPACE = "rollout_service"

RESTART_WAIT_S = 120.0  # how long a call waits for a restarting pool actor before raising
_RETRY_PAUSE_S = 0.2


def ensure_ray() -> None:
    init_ray()  # joins the cluster of RAY_ADDRESS / `ray start`, else starts a local one


class RolloutClient:
    """Handle on a rollout pool found by name (start one with rollout_service.start_pool). Thread-safe;
    the sync and async calls can be mixed. As a context manager it shuts the pool down on exit only
    when start_pool made this client (the pool's owner). restart_wait_s: how long a call waits for a
    pool actor that is restarting (see the module doc)."""

    def __init__(self, name: str = "rollout", namespace: str = DEFAULT_NAMESPACE, *,
                 restart_wait_s: float = RESTART_WAIT_S, _handle=None, _info: dict | None = None):
        ensure_ray()
        self.name, self.namespace = name, namespace
        self.restart_wait_s = restart_wait_s
        if _handle is None:
            _handle = _find_pool(name, namespace)
        self._pool = _handle
        self.info = _info  # what start_pool saw at start (digest, canonical config, workers); else None

    def __reduce__(self):
        # a client carried to another process (a trainer rank) reaches the same pool, and never owns it
        return (_client_of, (self.name, self.namespace, self._pool, self.restart_wait_s))

    def __eq__(self, other) -> bool:
        """Clients of the same pool actor are equal."""
        return isinstance(other, RolloutClient) and other._pool._actor_id == self._pool._actor_id

    def __hash__(self) -> int:
        return hash(self._pool._actor_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.info is not None:
            self.shutdown()

    # -- generation ------------------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], params, request_ids: list[str] | None = None):
        """Start generating; returns (ObjectRef of list[Rollout], request ids for cancel()). Errors
        follow params.check_batch's contract: a malformed call raises, a request that cannot be
        served comes back with finish_reason "error". The ref is one call: unlike generate(), it does
        not ride over a restart of the pool's actor."""
        requests = self._requests(prompts, params, request_ids)
        return self._pool.generate.remote(requests), [key for key, _, _ in requests]

    @staticmethod
    def _requests(prompts, params, request_ids) -> list[tuple]:
        check_batch(prompts, params)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        if request_ids is None:
            request_ids = [uuid.uuid4().hex for _ in prompts]
        elif len(request_ids) != len(prompts) or len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must be unique, one per prompt")
        return [(str(key), _as_ids(p), sp) for key, p, sp in zip(request_ids, prompts, params)]

    def generate(self, prompts: list[list[int]], params, request_ids: list[str] | None = None,
                 timeout: float | None = None) -> list[Rollout]:
        """Rollouts in request order; a request that cannot be served comes back with
        finish_reason "error" and a message, without failing the others."""
        requests = self._requests(prompts, params, request_ids)
        try:
            return self._get(lambda pool: pool.generate.remote(requests), timeout=timeout)
        except BaseException:  # timeout or interrupt: don't leave the work running
            self._pool.cancel.remote([key for key, _, _ in requests])
            raise

    async def generate_async(self, prompts: list[list[int]], params,
                             request_ids: list[str] | None = None) -> list[Rollout]:
        requests = self._requests(prompts, params, request_ids)
        deadline = None
        while True:
            try:
                return await self._pool.generate.remote(requests)
            except ActorUnavailableError:
                deadline = self._restart_deadline(deadline)
                await asyncio.sleep(_RETRY_PAUSE_S)
            except asyncio.CancelledError:
                self._pool.cancel.remote([key for key, _, _ in requests])
                raise

    def cancel(self, request_ids: list[str] | str) -> int:
        """Cancel requests; they finish with finish_reason "abort". Returns how many were running."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        return self._get(lambda pool: pool.cancel.remote([str(k) for k in request_ids]))

    # -- a pool actor that restarts ----------------------------------------------------------------

    def _get(self, call, timeout: float | None = None, unwrap: bool = False):
        """ray.get(call(pool)), called again while the pool's actor restarts (for at most restart_wait_s;
        `timeout` bounds the whole); unwrap: raise the pool's own error out of Ray's wrapper."""
        end = None if timeout is None else time.monotonic() + timeout
        deadline = None
        while True:
            try:
                left = None if end is None else max(0.0, end - time.monotonic())
                return ray.get(call(self._pool), timeout=left)
            except ActorUnavailableError:
                deadline = self._restart_deadline(deadline)
                time.sleep(_RETRY_PAUSE_S)
            except RayTaskError as e:
                if unwrap:
                    raise original_error(e) from e
                raise

    def _restart_deadline(self, deadline: float | None) -> float:
        """The time by which the pool must be back (set at the first failure); raises past it."""
        now = time.monotonic()
        if deadline is None:
            return now + self.restart_wait_s
        if now >= deadline:
            raise TimeoutError(f"rollout pool {self.name!r} (namespace {self.namespace!r}) was still unavailable "
                               f"{self.restart_wait_s:g} s after its actor began restarting (restart_wait_s)")
        return deadline

    # -- weights and status ----------------------------------------------------------------------

    def update_weights(self, state_dict, expected_digest: str | None = None, transport: str = "object_store",
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, mode: str = "drain",
                       stage_bytes: int = DEFAULT_STAGE_BYTES) -> str:
        """Load `state_dict` (name -> tensor) into every worker and return their common digest.

        transport: "auto" (weight_sync.choose_transport), "object_store" (the tensors enter Ray's object
        store once; every worker reads the same object), "broadcast" (a NCCL/gloo group from this process
        to the workers, in buckets of `bucket_bytes`) or "ipc" (workers on this process's GPU read the
        sender's buffer in place); see rollout_service.service.weight_sync. Those two stage the whole
        push in one buffer on this process's device when it fits in `stage_bytes` (0: bucket by bucket,
        holding one bucket). Every check (names, shapes, finite values, `expected_digest`) passes before
        any worker loads anything: a refused push raises WeightMismatchError and every worker keeps
        serving the weights it had. One push, as a WeightPush (weight_sync.session) does it.

        mode: when the push takes effect for running requests (rollout_service.service.switch_modes):
        "drain" (the default), "finish-then-switch" or "switch-in-flight" (native engines only);
        bucketed transports switch in "drain" mode. Rollout.weight_versions stamps every token.
        """
        device = next((t.device for t in state_dict.values()), None) if transport == "auto" else None
        push = WeightPush(self, transport, device, bucket_bytes=bucket_bytes, stage_bytes=stage_bytes, mode=mode)
        return push.load(state_dict, expected_digest)

    def load_adapter(self, name: str, adapter, expected_digest: str | None = None, transport: str = "object_store",
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, stage_bytes: int = DEFAULT_STAGE_BYTES) -> str:
        """Serve a LoRA adapter on every worker as `name` (a request names it: SamplingParams.adapter); the
        adapter of that name, if any, is replaced (a new weight version). Only the adapter travels.

        adapter: a rollout_service.lora.LoraAdapter (its tensors on this process's device choose the
        transport as update_weights does) or a PEFT checkpoint directory (read here). Every worker checks
        it before serving it: names, shapes and rank against the base, finite values and, where given,
        `expected_digest` = rollout_service.lora.push_digest(the adapter's digest, its base's), so an
        adapter for other base weights is refused too. A refused adapter raises AdapterError and every
        worker keeps serving what it had. Returns push_digest(the adapter's digest, the pool's base)."""
        from rollout_service.lora import LoraAdapter, load_adapter
        if not isinstance(adapter, LoraAdapter):
            adapter = load_adapter(adapter)
        device = next((t.device for t in adapter.tensors.values()), None) if transport == "auto" else None
        push = WeightPush(self, transport, device, bucket_bytes=bucket_bytes, stage_bytes=stage_bytes,
                          adapter=(name, adapter.settings(), expected_digest))
        return push.load(dict(adapter.tensors))

    def adapters(self) -> dict:
        """name -> digest of every LoRA adapter the pool serves."""
        return self._get(lambda pool: pool.adapters.remote())

    # the pool's calls of a WeightPush (rollout_service.service.weight_sync.session)
    def _switch_weights(self, ref, digest: str, mode: str, adapter: dict | None = None) -> str:
        """An object-store push: every worker to the weights of `ref`, whose digest is `digest`; with
        `adapter` (WeightPush.adapter), to serve the LoraAdapter of `ref` as that adapter."""
        if adapter is not None:
            return self._get(lambda pool: pool.load_adapter.remote(adapter["name"], [ref], adapter["expected"], digest),
                             unwrap=True)
        return self._get(lambda pool: pool.update_weights.remote([ref], digest, mode), unwrap=True)

    def _begin_weight_sync(self, plan, wait: bool = True):
        """The pool's begin of a bucketed push; wait=False: the call's ref, for _await_begin."""
        ref = self._pool.begin_weight_sync.remote(plan.to_wire())
        return self._await_begin(ref) if wait else ref

    @staticmethod
    def _await_begin(ref) -> dict:
        return _unwrapped(ref)

    def _end_weight_sync(self, sync_id: str, error: str | None = None, then=None, digest: str | None = None,
                         declined: bool = False) -> dict:
        """The pool's verdict on a bucketed push (digest: the sender's, for a broadcast push, whose plan
        carried none); `then`, where given, runs once the call is on its way. declined: the sender
        refused the push and told every worker so (a broadcast header's no-go)."""
        ref = self._pool.end_weight_sync.remote(sync_id, error, digest, declined)
        if then is not None:
            then()
        return _unwrapped(ref)

    def weights_digest(self) -> str:
        return self._get(lambda pool: pool.weights_digest.remote())

    def sleep(self) -> None:
        """Release the engines' GPU memory while another job (a colocated trainer) uses it: requests
        finish first; the next request or weight push wakes an engine, wake() does it ahead of time."""
        self._get(lambda pool: pool.sleep.remote(), unwrap=True)

    def wake(self) -> None:
        self._get(lambda pool: pool.wake.remote(), unwrap=True)

    def capabilities(self):
        """What every worker's engine can do: rollout_service.engine.protocol.EngineCapabilities."""
        return self._get(lambda pool: pool.capabilities.remote())

    def stats(self) -> dict:
        """Request counts, requests in flight, the weights digest, and each worker's state. "prefix_cache",
        per worker and for the pool: the prompt tokens of the rollouts served, how many of them the
        workers' prefix caches served (vLLM workers) and their ratio, "hit_rate"; None where no worker has a
        prefix cache. The counts only grow: rollout_service.service.prefix_cache_stats.between gives them
        between two snapshots."""
        return self._get(lambda pool: pool.stats.remote())

    def shutdown(self) -> None:
        """Stop the pool: every worker (releasing its CPUs/GPUs and placement group), then the pool
        actor itself. Works from any driver, e.g. for a detached pool."""
        from ray.exceptions import RayActorError

        try:
            self._get(lambda pool: pool.shutdown.remote())
        except (RayActorError, TimeoutError):
            pass  # already gone
        ray.kill(self._pool)

    def workers(self) -> list:
        """The current RolloutWorker actor handles, in slot order."""
        return self._get(lambda pool: pool.worker_handles.remote())


def _client_of(name: str, namespace: str, handle, restart_wait_s: float = RESTART_WAIT_S) -> RolloutClient:
    return RolloutClient(name, namespace=namespace, restart_wait_s=restart_wait_s, _handle=handle)


def _find_pool(name: str, namespace: str):
    """The pool actor named `name` in `namespace`; ValueError naming the namespaces that do hold the name."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as e:
        elsewhere = sorted({a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["name"] == name})
        hint = (f"; an actor of that name is in namespace(s) {elsewhere}: "
                f"RolloutClient({name!r}, namespace={elsewhere[0]!r})" if elsewhere else "")
        raise ValueError(f"no rollout pool named {name!r} in namespace {namespace!r}{hint}") from e


def _unwrapped(ref):
    """ray.get, raising the pool's own error (its type and message; Ray's error, with the remote
    traceback, as its __cause__)."""
    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise original_error(e) from e


def _as_ids(prompt):
    if hasattr(prompt, "tolist"):  # tensors and arrays
        prompt = prompt.tolist()
    return list(prompt) if isinstance(prompt, tuple) else prompt
