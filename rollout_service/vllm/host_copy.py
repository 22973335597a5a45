"""A vLLM worker's host copy of its weights: what it reports and verifies (digest, state_dict), what
restarts copy and what engines whose weights were discarded by sleep reload. Bucketed pushes reach it
behind the push, on a stream of its own (see HostWeights.load)."""
from __future__ import annotations

import itertools
import threading

import torch

from rollout_service.engine.model_loading import load_model
from rollout_service.weights import copy_into


def pin_host_copy(model: torch.nn.Module) -> None:
    """Page-lock the host copy's tensors, once: every push copies each bucket into it from the GPU,
    and a copy into pageable memory runs at a fraction of the link's speed (tied tensors stay tied:
    each Parameter object is re-pointed once)."""
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            t.data = t.data.pin_memory()


class HostWeights:
    """`model` loaded on the host (page-locked when the engines run on CUDA); read it as .model, which
    first waits for the copies of a push still in flight."""

    def __init__(self, model, device: torch.device, copy_model: bool = True):
        self.device = device
        self._model = load_model(model, "cpu", copy_model)
        if device.type == "cuda":
            pin_host_copy(self._model)
        # its state dict, for the copies of every push; rule: its tensors are only ever written in
        # place after this (copy_into, load_weights), so the entries stay the model's
        self._tensors = self._model.state_dict()
        self._stream = None  # see load
        self._copies: list[tuple[torch.cuda.Event, list]] = []  # (done, the tensors it reads), in flight
        self._lock = threading.Lock()  # held while waiting for them (see wait)
        self._unissued: list = []  # loaded, its copy not yet issued (see load)
        self._sources_ready = None  # an event after which the unissued copies' sources may be read

    @property
    def model(self) -> torch.nn.Module:
        """The weights last loaded, once every copy into them has landed."""
        self.wait()
        return self._model

    def wait(self) -> None:
        """Until every copy into the host copy has landed (any not yet issued first); then its tensors
        are let go."""
        with self._lock:
            self._issue()
            for done, _ in self._copies:
                done.synchronize()
            self._copies.clear()

    def load(self, named: list) -> None:
        """Copy (name, tensor) pairs in. Off CUDA at once; on a GPU the copy to the (page-locked) host
        copy runs on a stream of its own and is not waited for: it reads the caller's tensors while
        rollouts go on, at the host link's speed, which is most of a push's time otherwise. It is issued
        by the thread finish_in_background starts, or at wait, not bucket by bucket: its device-to-host
        traffic shares the copy engine with the small reads of the next buckets' checks, and held them
        up; and issuing a copy per tensor takes milliseconds of host time, which the push's verdict
        need not wait for.

        Rule: the caller writes to `named` again only after wait() (a staged push's buffer is never
        written again: the sender's stage, read by CUDA IPC, or the receiver's buffer); they are kept
        until the copy has read them (the thread of finish_in_background lets go of them once it
        lands), and whatever reads .model waits first."""
        if self.device.type != "cuda":
            copy_into(self._tensors, named)
            return
        with self._lock:  # the sources are ready on this thread's stream, now
            self._unissued.extend(named)
            self._sources_ready = torch.cuda.current_stream(self.device).record_event()

    def _issue(self) -> None:
        """The copies of what was loaded since the last issue, behind what made their sources on the
        loading thread's stream (the caller, on any thread, holds _lock)."""
        if not self._unissued:
            return
        named, self._unissued = self._unissued, []
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_event(self._sources_ready)
        with torch.cuda.stream(self._stream):
            copy_into(self._tensors, named)
            self._copies.append((self._stream.record_event(), named))

    def finish_in_background(self) -> None:
        """The push is complete: a thread issues its copies, waits for them to land and lets go of the
        push's buffers, so that an idle engine does not keep them (a sender's stage read by CUDA IPC
        stays allocated on its GPU until then)."""
        if self._unissued or self._copies:
            threading.Thread(target=self.wait, name="host-copy", daemon=True).start()
