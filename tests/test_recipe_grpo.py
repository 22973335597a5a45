"""The tiny GRPO recipe end to end on a local Ray cluster (2 FSDP2 trainer ranks on gloo, 2 rollout
workers): rollout/train KL and max |Δ log-prob| exactly 0.0 every step, a non-zero KL for the
determinism-off baseline, and a resumed run that reproduces the next step's rollouts bit for bit.
With the tiny Qwen3-MoE policy (tiny_moe.yaml) the routing the rollouts recorded is the trainer's at
every step (routing_agreement 1.0), and the `off` baseline's is not; dense runs log no routing metrics."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from recipes.config import load_config  # noqa: E402
from recipes.grpo import GRPOJob, run  # noqa: E402
from recipes.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow  # every test runs the recipe, on a local Ray cluster

TINY = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "tiny.yaml"
TINY_MOE = TINY.with_name("tiny_moe.yaml")
# Short: 3 steps of 8 prompts x 8 samples at T=0.8 (log-probs of logits / T); checkpoints at steps 2, 3.
SHORT = ["train.steps=3", "train.prompts_per_step=8", "train.save_every=2", "train.save_rollouts=true",
         "warmup.steps=30", "rollout.temperature=0.8"]
# the stock pipeline: fast path alone, the unpatched model, old log-probs recomputed
STOCK = ["numerics=stock", "rollout.determinism=off", "trainer.loss.old_logprobs=recompute"]


@pytest.fixture(scope="module")
def verified_run(local_ray, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("verified")
    cfg = load_config(TINY, SHORT + [f"run_dir={run_dir}", "metrics.wandb_mode=offline"])
    result = run(cfg, progress=False)
    return Path(result["run_dir"]), result["records"]


def _rollout_lines(run_dir: Path, step: int) -> list[str]:
    return (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()


def test_verified_run_has_exactly_zero_kl_every_step(verified_run):
    run_dir, records = verified_run
    logged = read_metrics(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3] == [r["step"] for r in records]
    for rec in logged:
        assert rec["rollout_train/kl"] == 0.0, rec
        assert rec["rollout_train/kl_k3"] == 0.0, rec
        assert rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["rollout_train/mismatched_tokens"] == 0, rec
        assert rec["rollout_train/tokens"] > 0
        assert 0.0 <= rec["reward/mean"] <= 1.0
        assert rec["dvr/verify_windows"] > 0
        assert not any("routing" in key for key in rec), rec  # a dense policy: no routing metrics
        for key in ("perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "perf/step_s"):
            assert rec[key] > 0
    assert len(_rollout_lines(run_dir, 1)) == 8 * 8
    # wandb ran offline into the run directory
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_resume_reproduces_next_step_bitwise(verified_run, tmp_path):
    run_dir, records = verified_run
    ckpt = run_dir / "checkpoints" / "step_000002"
    assert json.loads((ckpt / "state.json").read_text())["step"] == 2
    result = run(load_config(TINY, SHORT + [f"run_dir={tmp_path}", "metrics.wandb=false"]), resume=ckpt,
                 progress=False)
    assert [r["step"] for r in result["records"]] == [3]
    again = result["records"][0]
    assert again["rollout/digest"] == records[2]["rollout/digest"]
    assert _rollout_lines(tmp_path, 3) == _rollout_lines(run_dir, 3)
    assert again["rollout_train/kl"] == 0.0 and again["rollout_train/max_abs_logprob_diff"] == 0.0
    assert again["weights/digest"] == records[2]["weights/digest"]  # the update after it, too


@pytest.mark.parametrize("stage_mb", [8192, 0], ids=["staged", "streamed"])
def test_broadcast_weight_sync_carries_the_same_weights(verified_run, tmp_path, stage_mb):
    """trainer.weight_push.transport=broadcast (one parameter gathered at a time from the 2 FSDP2 ranks, into
    a stage of the whole push or bucket by bucket, then buckets over a gloo group) lands the bits the
    object store does: the same weights and the same rollouts at every step."""
    _, records = verified_run
    push = ["trainer.weight_push.transport=broadcast", f"trainer.weight_push.stage_mb={stage_mb}"]
    cfg = load_config(TINY, SHORT + [f"run_dir={tmp_path}", "metrics.wandb=false", *push])
    again = run(cfg, progress=False)["records"]
    assert [r["weights/transport"] for r in again] == ["broadcast"] * 3
    assert [r["weights/staged"] for r in again] == [stage_mb > 0] * 3
    assert [r["weights/transport"] for r in records] == ["object_store"] * 3  # auto on CPU
    assert [r["weights/digest"] for r in again] == [r["weights/digest"] for r in records]
    assert [r["rollout/digest"] for r in again] == [r["rollout/digest"] for r in records]
    assert all(r["rollout_train/kl"] == 0.0 for r in again)
    phases = ("connect", "check", "begin", "send", "finish")  # where each push's time went, within it
    worker = [f"worker_{p}" for p in ("receive", "check", "load", "engine")]  # each worker's own share
    for r in again:
        assert all(r[f"perf/sync_{p}_s"] > 0.0 for p in phases + tuple(worker)), r
        assert sum(r[f"perf/sync_{p}_s"] for p in phases) <= r["perf/sync_push_s"]
        # each phase of the slowest worker's (per phase: the pool keeps each phase's maximum over the
        # workers, so their sum may exceed any one worker's time) lies between begin and the verdict
        window = sum(r[f"perf/sync_{p}_s"] for p in phases[2:])
        assert all(r[f"perf/sync_{p}_s"] <= window for p in worker), r
    assert all("perf/sync_send_s" not in r and r["perf/sync_connect_s"] > 0.0 for r in records)
    # every push after a train step was armed as the step began: its begin was asked that far ahead
    assert all(r["perf/sync_armed_ahead_s"] >= r["perf/train_s"] * 0.5 for r in again), again


def test_one_rank_staged_pushes_carry_each_steps_new_weights(local_ray, tmp_path):
    """One trainer rank keeps its state dict's entries between staged pushes (no gather there): every
    push still carries that step's updated weights, the ones the object store carries."""
    one_rank = SHORT + ["metrics.wandb=false", "trainer.num_ranks=1", "train.save_every=0"]
    by_store = run(load_config(TINY, one_rank + [f"run_dir={tmp_path / 'store'}"]), progress=False)["records"]
    broadcast = "trainer.weight_push.transport=broadcast"
    staged_cfg = load_config(TINY, one_rank + [f"run_dir={tmp_path / 'staged'}", broadcast])
    staged = run(staged_cfg, progress=False)["records"]
    assert [r["weights/staged"] for r in staged] == [True] * 3
    digests = [r["weights/digest"] for r in staged]
    assert digests == [r["weights/digest"] for r in by_store] and len(set(digests)) == 3
    assert [r["rollout/digest"] for r in staged] == [r["rollout/digest"] for r in by_store]
    assert all(r["rollout_train/kl"] == 0.0 for r in staged)


def test_baseline_determinism_off_has_nonzero_kl(local_ray, tmp_path):
    cfg = load_config(TINY, ["train.steps=2", "train.prompts_per_step=8", "warmup.steps=30",
                             "rollout.determinism=off", f"run_dir={tmp_path}", "metrics.wandb=false"])
    records = run(cfg, progress=False)["records"]
    assert len(records) == 2
    assert any(r["rollout_train/kl"] != 0.0 for r in records), records
    assert all(r["rollout_train/max_abs_logprob_diff"] > 0.0 for r in records)
    assert all(r["dvr/verify_windows"] == 0 for r in records)


def test_moe_run_has_zero_kl_and_identical_routing_every_step(local_ray, tmp_path):
    cfg = load_config(TINY_MOE, ["train.steps=3", "train.prompts_per_step=8", "warmup.steps=30",
                                 "rollout.temperature=0.8", "train.save_rollouts=true", f"run_dir={tmp_path}",
                                 "metrics.wandb=false"])
    records = run(cfg, progress=False)["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for rec in records:
        assert rec["rollout_train/kl"] == 0.0 and rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["rollout_train/mismatched_tokens"] == 0 and rec["rollout_train/tokens"] > 0, rec
        assert rec["rollout_train/routing_agreement"] == 1.0, rec
        assert rec["rollout_train/routing_mismatches"] == 0, rec
        assert rec["dvr/verify_windows"] > 0
    line = json.loads(_rollout_lines(tmp_path, 1)[0])
    assert len(line["routed_experts"]) == len(line["tokens"])  # [token][layer][k]
    assert all(len(t) == 2 and len(t[0]) == 2 for t in line["routed_experts"])


def test_moe_baseline_determinism_off_routes_differently(local_ray, tmp_path):
    """The `off` fast path routes some tokens differently from the trainer: the metric can fail."""
    cfg = load_config(TINY_MOE, ["train.steps=3", "warmup.steps=30", "rollout.determinism=off",
                                 f"run_dir={tmp_path}", "metrics.wandb=false"])
    records = run(cfg, progress=False)["records"]
    assert len(records) == 3
    assert any(r["rollout_train/routing_agreement"] < 1.0 for r in records), records
    assert all(r["rollout_train/routing_mismatches"] == round(
        (1 - r["rollout_train/routing_agreement"]) * r["rollout_train/tokens"] * 2) for r in records)


def test_moe_stock_arm_sets_its_routing_beside_the_rollouts(local_ray, tmp_path):
    """The stock arm on an MoE policy: the unpatched model's routing (its routers' own top-k) is measured against
    the routing the `off` rollouts recorded, like the logprobs; the two stock sides flip some decisions."""
    cfg = load_config(TINY_MOE, ["train.steps=3", "warmup.steps=30", *STOCK, f"run_dir={tmp_path}",
                                 "metrics.wandb=false"])
    records = run(cfg, progress=False)["records"]
    assert len(records) == 3
    assert all(r["rollout_train/kl"] != 0.0 for r in records), records
    assert all(r["rollout_train/routing_mismatches"] == round(
        (1 - r["rollout_train/routing_agreement"]) * r["rollout_train/tokens"] * 2) for r in records)
    assert any(r["rollout_train/routing_agreement"] < 1.0 for r in records), records


@pytest.mark.parametrize("sleep", [True, False], ids=["engines-sleep", "engines-awake"])
def test_colocated_placement_lands_the_split_runs_bits(verified_run, tmp_path, sleep):
    """placement: colocated (worker i and trainer rank i on bundle i of one placement group; the
    engines sleep while the ranks train, a no-op on CPU, unless rollout.sleep_while_training is
    false) changes where things run, not what they compute: the same weights and rollouts as the
    split run at every step, KL 0. Engines kept awake are never asked to sleep."""
    _, records = verified_run
    cfg = load_config(TINY, SHORT + [f"run_dir={tmp_path}", "metrics.wandb=false", "placement=colocated",
                                     f"rollout.sleep_while_training={str(sleep).lower()}"])
    again = run(cfg, progress=False)["records"]
    assert [r["weights/digest"] for r in again] == [r["weights/digest"] for r in records]
    assert [r["rollout/digest"] for r in again] == [r["rollout/digest"] for r in records]
    assert all(r["rollout_train/kl"] == 0.0 and r["rollout_train/max_abs_logprob_diff"] == 0.0 for r in again)
    assert all((r["perf/sleep_s"] > 0.0) == sleep for r in again) and all(r["perf/sleep_s"] == 0.0 for r in records)


def test_stock_arm_has_nonzero_kl(local_ray, tmp_path):
    """numerics: stock, the pipeline users run today on the same data, model and optimizer: rollouts
    on the fast path alone (`off`), the unpatched model (SDPA) in the trainer, old log-probs
    recomputed. Its rollout-vs-train KL is logged the same way and is not zero."""
    cfg = load_config(TINY, ["train.steps=2", "train.prompts_per_step=8", "warmup.steps=30", *STOCK,
                             f"run_dir={tmp_path}", "metrics.wandb=false"])
    records = run(cfg, progress=False)["records"]
    assert len(records) == 2
    assert all(r["rollout_train/kl"] != 0.0 for r in records), records
    assert all(r["rollout_train/max_abs_logprob_diff"] > 0.0 for r in records)
    assert all(r["rollout_train/mismatched_tokens"] > 0 for r in records)


def test_two_jobs_taking_steps_in_turns_keep_each_jobs_bits(verified_run, tmp_path):
    """GRPOJob.steps() yields each step as it ends, so one process can run two jobs on one Ray taking
    steps in turns (bench.grpo_step --interleave): the zero-KL job's weights and rollouts are the job's
    alone at every step, the stock job beside it has its non-zero KL, and a job whose steps are closed
    early is torn down (its pool gone)."""
    from rollout_service.service.client import DEFAULT_NAMESPACE
    _, alone = verified_run
    zero_kl = GRPOJob(load_config(TINY, SHORT + [f"run_dir={tmp_path / 'zero-kl'}", "metrics.wandb=false"]))
    zero_kl = zero_kl.steps(False)
    stock = GRPOJob(load_config(TINY, SHORT + STOCK + [f"run_dir={tmp_path / 'stock'}", "metrics.wandb=false",
                                                       "rollout.pool_name=stock-in-turns"])).steps(False)
    in_turns, stock_records = [], []
    for _ in range(2):
        in_turns.append(next(zero_kl))
        stock_records.append(next(stock))
    assert ray.get_actor("stock-in-turns", namespace=DEFAULT_NAMESPACE) is not None
    stock.close()
    with pytest.raises(ValueError):
        ray.get_actor("stock-in-turns", namespace=DEFAULT_NAMESPACE)
    in_turns += list(zero_kl)
    assert [r["weights/digest"] for r in in_turns] == [r["weights/digest"] for r in alone]
    assert [r["rollout/digest"] for r in in_turns] == [r["rollout/digest"] for r in alone]
    assert all(r["rollout_train/kl"] == 0.0 and r["rollout_train/max_abs_logprob_diff"] == 0.0 for r in in_turns)
    assert all(r["rollout_train/max_abs_logprob_diff"] > 0.0 for r in stock_records)
