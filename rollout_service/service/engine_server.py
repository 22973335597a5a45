"""EngineServer: one engine serving many requests at once, from an async actor (RolloutWorker).

Callers await `generate`; a background task feeds new requests to the engine and calls
`engine.step()` while any are unfinished, so concurrent requests share the engine's batches. Every
engine call runs on one dedicated thread (the engine is not thread-safe), which keeps the event loop
free to accept requests, aborts and weight updates while a step runs.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from rollout_service.params import Rollout
from rollout_service.service.request_outcomes import EarlyCancels, abort_rollout, error_rollout
from rollout_service.service.switch_modes import SWITCH_IN_FLIGHT, engine_switch_modes


class EngineServer:
    """The request loop of one engine, and the gate that weight changes and sleep pass through (drain,
    hold). `engine` None: it could not be built (the actor reports why)."""

    def __init__(self, engine):
        self._engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._pending: list[tuple[str, list, object]] = []  # not yet handed to the engine
        self._futures: dict[str, asyncio.Future] = {}
        self._prompts: dict[str, list] = {}
        self._rid_of: dict[str, int] = {}  # key -> engine request id, while in the engine
        self._key_of: dict[int, str] = {}
        self._to_abort: list[int] = []
        self._aborted_rids: set[int] = set()
        self._early_aborts = EarlyCancels()
        self._updating = False
        self._ticking = False
        self._asleep = False  # engine memory released (sleep); touched only on the engine thread
        self._completed = 0
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._loop_task: asyncio.Task | None = None
        # the version id of the weights the engine holds (the pool's count of adopted pushes; set and read
        # on the engine thread only), and each admitted request's version at admission (event loop)
        self._version = 0
        self._admitted_version: dict[str, int] = {}
        self._switch_modes = engine_switch_modes(engine) if engine is not None else ()

    def _start(self):
        # asyncio objects must be made on the actor's event loop, which __init__ does not run on.
        if self._wake is None:
            self._wake, self._changed = asyncio.Event(), asyncio.Event()
            self._update_lock = asyncio.Lock()
        if self._loop_task is None or self._loop_task.done():  # (re)started by the next call
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    def _call(self, fn, *args) -> asyncio.Future:
        """fn(*args) on the engine's thread (awaitable)."""
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- requests --------------------------------------------------------------------------------

    async def generate(self, key: str, prompt, params) -> Rollout:
        self._start()
        if self._early_aborts.pop(key):
            return abort_rollout(prompt)
        if key in self._futures:
            return error_rollout(prompt, f"duplicate request id {key!r} on this worker")
        fut = asyncio.get_running_loop().create_future()
        self._futures[key], self._prompts[key] = fut, prompt
        self._pending.append((key, prompt, params))
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:  # the caller cancelled this call (ray.cancel)
            self._abort(key)
            raise

    async def abort(self, key: str) -> None:
        self._start()
        self._abort(key)

    def _abort(self, key: str) -> None:
        if key in self._rid_of:
            self._to_abort.append(self._rid_of[key])
            self._wake.set()
        elif key in self._futures:  # still pending: never reached the engine
            self._pending = [p for p in self._pending if p[0] != key]
            self._resolve(key, abort_rollout(self._prompts[key]))
        else:
            self._early_aborts.add(key)

    def _resolve(self, key: str, rollout: Rollout) -> None:
        version = self._admitted_version.pop(key, None)
        if version is not None and SWITCH_IN_FLIGHT not in self._switch_modes:
            # weights change only with nothing in this engine: the whole request ran on one version
            rollout.weight_versions = [version] * len(rollout.token_ids)
        fut = self._futures.pop(key, None)
        self._prompts.pop(key, None)
        rid = self._rid_of.pop(key, None)
        if rid is not None:
            self._key_of.pop(rid, None)
            self._aborted_rids.discard(rid)
        if fut is not None and not fut.done():
            self._completed += 1
            fut.set_result(rollout)

    async def _serve(self):
        while True:
            admit = [] if self._updating else self._pending
            if not (admit or self._to_abort or self._rid_of):
                self._changed.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._updating:
                self._pending = []
            aborts, self._to_abort = self._to_abort, []
            self._ticking = True
            try:
                added, finished, idle = await self._call(self._tick, admit, aborts)
            except Exception as e:  # the engine failed: fail what it held rather than hang
                rids = list(self._rid_of.values())
                for key in list(self._rid_of):
                    self._resolve(key, error_rollout(self._prompts.get(key), f"engine failure: {e!r}"))
                for key, prompt, _ in admit:
                    self._resolve(key, error_rollout(prompt, f"engine failure: {e!r}"))
                try:  # and free what the engine still holds for them
                    await self._call(self._abort_all, rids)
                except Exception:
                    pass
                continue
            finally:
                self._ticking = False
            for key, rid, version in added:
                self._admitted_version[key] = version
                if isinstance(rid, Exception):
                    self._resolve(key, error_rollout(self._prompts.get(key), f"{type(rid).__name__}: {rid}"))
                    continue
                self._rid_of[key], self._key_of[rid] = rid, key
                if key not in self._futures:  # its caller went away while it was being added
                    self._to_abort.append(rid)
            self._aborted_rids.update(aborts)
            for rid, rollout in finished:
                key = self._key_of.get(rid)
                if key is not None:
                    self._resolve(key, rollout)
            if idle:  # the engine holds nothing, so anything still tracked will never finish
                for key in list(self._rid_of):
                    rid = self._rid_of[key]
                    self._resolve(key, abort_rollout(self._prompts.get(key)) if rid in self._aborted_rids
                                  else error_rollout(self._prompts.get(key), "the engine dropped the request"))
            self._changed.set()

    def _abort_all(self, rids):
        for rid in rids:
            self._engine.abort(rid)

    def _tick(self, admit, aborts):
        """One engine round on the engine thread: admit, abort, step."""
        self._wake_engine()
        added = []
        for key, prompt, params in admit:
            try:
                added.append((key, self._engine.add_request(prompt, params), self._version))
            except Exception as e:  # InvalidRequestError and anything else this request cannot pass
                added.append((key, e, None))
        for rid in aborts:
            self._engine.abort(rid)
        finished = self._engine.step() if self._engine.has_unfinished() else []
        return added, finished, not self._engine.has_unfinished()

    async def _drain(self) -> None:
        """Stop admitting requests and wait until the engine holds none."""
        self._updating = True
        while self._rid_of or self._ticking:
            self._changed.clear()
            await self._changed.wait()

    def _resume(self) -> None:
        self._updating = False
        self._wake.set()

    async def _hold(self) -> None:
        """Serve nothing until _release: other weight changes wait, and the engine holds no request."""
        await self._update_lock.acquire()
        try:
            await self._drain()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        self._resume()
        self._update_lock.release()

    def _sleep_engine(self) -> None:
        if not self._asleep:
            self._engine.sleep()
            self._asleep = True

    def _wake_engine(self) -> None:
        if self._asleep:
            self._engine.wake()
            self._asleep = False

    def _set_version(self, version: int | None) -> None:
        """On the engine thread, right after a load: later admissions (and, in an engine that stamps
        tokens itself, later tokens) carry `version`."""
        self._version = self._version + 1 if version is None else version
        if SWITCH_IN_FLIGHT in self._switch_modes:
            self._engine.weight_version = self._version
