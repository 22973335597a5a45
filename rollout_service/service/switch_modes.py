"""When a weight push takes effect for the requests a pool is running (update_weights(mode=...)).

- "drain" (the default): no request is dispatched and none is in flight while the weights change;
  every rollout runs on one version.
- "finish-then-switch": each worker stops admitting, finishes what its engine holds on the old weights,
  then loads; new requests go only to workers already on the new weights. Every rollout still runs on
  one version, but the pool never waits for its slowest request.
- "switch-in-flight": each worker loads between two engine steps; running requests continue on the new
  weights from their next token, their prompt and generated tokens prefilled again under them first
  (Engine.update_weights). A rollout may span versions; Rollout.weight_versions says which token is whose.

Whatever the mode, a token's log-prob is the trainer's under the version it is stamped with, over the
whole prefix. Only engines whose KV is recomputed on a switch (the native Engine) take
"switch-in-flight"; a pool refuses it up front when any worker's engine cannot.
"""
from __future__ import annotations

DRAIN, FINISH_THEN_SWITCH, SWITCH_IN_FLIGHT = "drain", "finish-then-switch", "switch-in-flight"
SWITCH_MODES = (DRAIN, FINISH_THEN_SWITCH, SWITCH_IN_FLIGHT)


def check_switch_mode(mode) -> str:
    if mode not in SWITCH_MODES:
        raise ValueError(f"mode must be one of {SWITCH_MODES}, got {mode!r}")
    return mode


def engine_switch_modes(engine) -> tuple[str, ...]:
    """The modes a worker's engine can serve: switch-in-flight needs one that recomputes the running
    requests' KV under new weights (EngineCapabilities.switch_modes)."""
    return SWITCH_MODES if engine.capabilities().switch_modes else (DRAIN, FINISH_THEN_SWITCH)
