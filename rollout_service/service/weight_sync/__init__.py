"""Weights from a trainer (or any process holding them) to the rollout workers: one WeightPush a push.

Transports:
- "object_store": the whole state dict through ray.put; every worker reads the same object.
- "broadcast": a torch.distributed process group of the sender (rank 0) and every worker, NCCL on
  GPUs (gloo on CPU); each bucket is one broadcast. For workers on other GPUs than the sender.
- "ipc": the sender's bucket buffer is opened in place by workers on the same GPU through a CUDA IPC
  handle (colocated rollout and training). It has no CPU form: there the object store's shared
  memory is that path.

Two ways to feed a bucketed push (stages_whole picks by size):
- staged: one pass casts every tensor into one buffer holding the whole push on the sender's device
  and fingerprints it there (stage.py); the checks and the send then read that buffer. By ipc it is
  one bucket: each worker reads all of it in one call. By broadcast its buckets are sent back to
  back, and each worker checks and loads one while the next is in flight.
- streamed: a check pass (checks.fingerprint_entries), then a second pass that fills one bucket at a
  time: the sender never holds more than a bucket, at the price of reading the tensors twice.

Safety rule: no weight reaches a worker before every check has passed on the sender (names and
shapes against the pool's model, finite values, the expected digest), so a refused push leaves every
worker serving the weights it had. Each worker then checks every received tensor's fingerprint
against the sender's before loading it, which catches a broken transfer; a worker that fails there
holds part of the new weights and is restarted by the pool.

A push's fingerprints travel with the sender's go: by broadcast in its first broadcast, the header
(the go, or a no-go, and every tensor's fingerprint); by ipc in the call that hands the workers the
first bucket. The pool's begin therefore needs only the names and shapes, and a push may be
announced (WeightPush.announce) before its tensors exist, while the sender trains: the pool drains
and its workers wait meanwhile (by broadcast, in the group). If the checks then fail, the no-go
sends every worker back to serving, having loaded nothing.

A staged push's stage may be kept between pushes (SenderStage): allocated once and, by ipc, shared
once (its CUDA IPC handle), each worker keeping the buffer it opened from it, so no push pays for
allocating, sharing and opening the stage's memory again.

Files, one idea each: plan.py (the plan, its buckets, the transport choice), checks.py (the sender's
checks), stage.py (the staged buffer), groups.py (broadcast process groups), session.py (WeightPush,
the one object a caller uses), sender.py (the sender's data path), coordinator.py (the pool's side),
inbox.py and receiver.py (a worker's side).
"""
from .checks import check_digest, fingerprint_entries
from .plan import (
                   DEFAULT_BUCKET_BYTES,
                   DEFAULT_STAGE_BYTES,
                   TRANSPORTS,
                   WHOLE,
                   BucketEntry,
                   SyncPlan,
                   choose_transport,
                   plan_buckets,
                   stages_whole,
)
from .session import WeightPush
from .stage import SenderStage, stage_tensors

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_STAGE_BYTES", "TRANSPORTS", "WHOLE", "BucketEntry", "SenderStage",
           "SyncPlan", "WeightPush", "check_digest", "choose_transport", "fingerprint_entries", "plan_buckets",
           "stage_tensors", "stages_whole"]
