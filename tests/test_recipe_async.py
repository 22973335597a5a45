"""The tiny GRPO recipe with asynchronous steps (train.async_steps = 1 and 2) on a local Ray cluster: the
rollouts of the next steps are generated while the trainer steps, so tokens are sampled with weights one
or more versions behind the trainer's. Every step logs staleness, the importance ratio's spread and a
rollout/train KL of exactly 0.0 against the behaviour version. Each saved token's log-prob equals the
canonical forward's under the weights of the version it is stamped with, rebuilt by this test from the
run's checkpoints; scoring the stale tokens with the run's final weights instead (the control) differs.
With trainer.weight_push.switch=switch-in-flight a push lands while the next step's rollouts run: they continue
on the new weights, so a rollout may span two versions, and each of its tokens is checked at its own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

import torch.distributed.checkpoint as dcp  # noqa: E402

import trainer_patch  # noqa: E402
from recipes.checkpoint import checkpoint_dir  # noqa: E402
from recipes.config import load_config  # noqa: E402
from recipes.grpo import run, starting_model  # noqa: E402
from recipes.models import initial_model  # noqa: E402
from recipes.task import build_task  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "tiny.yaml"
# the first push's weights are the warmed-up initial model, which the test rebuilds the recipe's way
ASYNC = ["train.steps=5", "train.prompts_per_step=8", "train.save_every=1", "train.save_rollouts=true",
         "warmup.steps=30", "rollout.temperature=0.8", "metrics.wandb=false"]


# canonical steps of one token each, two requests at a time per worker: a push lands between two of a
# running rollout's tokens. Whether a push finds rollouts running is timing: a push lands mid-rollout
# only while the next step's generation outlasts the train step. Five steps (four pushes) on a loaded
# machine sometimes found none, and so did twelve steps at four requests a worker once the trainer's
# packed step got faster; two requests a worker double the generation's waves (10 of 768 rollouts
# spanned two versions in a run on two loaded cores).
IN_FLIGHT = ["trainer.weight_push.switch=switch-in-flight", "trainer.weight_push.transport=object_store",
             "train.steps=12", "rollout.determinism=invariant",
             "rollout.engine={window: 4, group: 8, kv_cache_tokens: 8192, max_num_seqs: 2}"]


# a staged push over a gloo group from the FSDP2 ranks, sending behind the next train step
OVERLAPPED = ["trainer.weight_push.transport=broadcast"]


@pytest.fixture(scope="module", params=[(1, []), (2, []), (1, IN_FLIGHT), (1, OVERLAPPED)],
                ids=["k1", "k2", "k1-in-flight", "k1-push-overlapped"])
def async_run(local_ray, tmp_path_factory, request):
    k, extra = request.param
    cfg = load_config(TINY, ASYNC + extra + [f"train.async_steps={k}", f"run_dir={tmp_path_factory.mktemp('async')}"])
    result = run(cfg, progress=False)
    return k, cfg, Path(result["run_dir"]), result["records"]


@pytest.mark.slow
def test_every_step_logs_staleness_ratio_spread_and_zero_kl_to_the_behaviour_version(async_run):
    k, cfg, _, records = async_run
    assert [r["step"] for r in records] == list(range(1, cfg.train.steps + 1))
    for rec in records:
        assert rec["rollout_train/kl"] == 0.0, rec
        assert rec["rollout_train/max_abs_logprob_diff"] == 0.0, rec
        assert rec["rollout_train/mismatched_tokens"] == 0 and rec["rollout_train/tokens"] > 0, rec
        assert 0 <= rec["async/staleness_mean"] <= rec["async/staleness_max"] <= k, rec
        assert rec["train/importance_ratio_min"] <= rec["train/importance_ratio_mean"] <= \
            rec["train/importance_ratio_max"]
    stale = [r for r in records if r["async/staleness_max"] > 0]
    assert stale, "rollouts must have been sampled with older weights than the trainer's"
    # stale tokens under updated weights: the ratio moves away from 1 (the staleness is real)
    assert any(r["train/importance_ratio_min"] < 1.0 < r["train/importance_ratio_max"] for r in stale)


def _weights_by_version(cfg, run_dir: Path, records: list[dict]) -> dict[int, torch.nn.Module]:
    """Every version's policy: the first push's = the warmed-up initial model (rebuilt: the warm-up is
    seeded); the version pushed after step s = step s's checkpoint (its fp32 masters; the canonical
    forward reads them as bf16, as the trainer's mixed precision does)."""
    task = build_task(cfg)
    first = records[0]["weights/version"] - 1
    models = {first: starting_model(cfg, task, resumed=False).float()}
    for rec in records:
        model = initial_model(cfg, task.tokenizer).float()
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(checkpoint_dir(run_dir, rec["step"]) / "trainer"))
        model.load_state_dict(state["model"])
        models[rec["weights/version"]] = model
    return {v: trainer_patch.patch_model(m.eval()) for v, m in models.items()}


def _scores(model, line: dict, temperature: float) -> list[float]:
    ids = torch.tensor([line["prompt"] + line["tokens"]])
    with torch.no_grad():
        logp = trainer_patch.token_logprobs(model, ids, temperature=temperature)[0]
    return logp[len(line["prompt"]) - 1:].tolist()


@pytest.mark.slow
def test_each_token_is_the_trainers_under_its_own_version_and_not_the_latest(async_run):
    _, cfg, run_dir, records = async_run
    models = _weights_by_version(cfg, run_dir, records)
    latest = models[max(models)]
    checked = stale_tokens = stale_differ = spanning = 0
    for rec in records:
        for raw in (run_dir / "rollouts" / f"step_{rec['step']:06d}.jsonl").read_text().splitlines():
            line = json.loads(raw)
            versions = line["weight_versions"]
            assert len(versions) == len(line["tokens"]) and versions == sorted(versions)
            spanning += len(set(versions)) > 1
            for version in set(versions):  # each token under its own version, over its whole prefix
                mine = [i for i, v in enumerate(versions) if v == version]
                scores = _scores(models[version], line, 0.8)
                assert [scores[i] for i in mine] == [line["logprobs"][i] for i in mine], (rec["step"], version)
            checked += len(versions)
            latest_scores = _scores(latest, line, 0.8)  # the control: the run's final weights alone
            for i, version in enumerate(versions):
                if version != max(models):
                    stale_tokens += 1
                    stale_differ += latest_scores[i] != line["logprobs"][i]
    assert checked > 0 and stale_tokens > 0
    assert stale_differ > 0.5 * stale_tokens, (stale_differ, stale_tokens)
    if cfg.trainer.weight_push.switch == "switch-in-flight":
        assert spanning > 0, "no rollout was running when a push switched the workers in flight"
    else:
        assert spanning == 0, "drain pushes never let a rollout span two versions"


@pytest.mark.slow
def test_staged_pushes_send_behind_the_next_train_step(async_run):
    """With asynchronous steps a staged bucketed push returns once checked and drained; its send runs
    while the next step trains, and that step's sync waits only for what is left of it. (Each token is
    checked against its version's checkpoint in the test above, so the weights sent are the version's
    own, not the next step's.) Object-store pushes land before they return."""
    _, cfg, _, records = async_run
    if cfg.trainer.weight_push.transport != "broadcast":
        assert all(r["weights/transport"] == "object_store" and "perf/sync_wait_s" not in r for r in records)
        return
    assert all(r["weights/transport"] == "broadcast" and r["weights/staged"] for r in records)
    for rec in records[1:]:  # each step's push waited for the last one's, sent behind this step's training
        assert rec["perf/sync_behind_send_s"] > 0.0 and rec["perf/sync_behind_finish_s"] > 0.0, rec
        assert 0.0 <= rec["perf/sync_wait_s"] <= rec["perf/weight_sync_s"], rec
        assert "perf/sync_send_s" not in rec  # this push's own send is behind the next step


def test_async_steps_need_the_split_placement_and_rollout_logprobs():
    from recipes.config import ConfigError
    for extra in (["placement=colocated"], ["trainer.loss.old_logprobs=recompute"], ["train.async_steps=-1"]):
        with pytest.raises(ConfigError, match="async_steps"):
            load_config(TINY, ["train.async_steps=1"] + extra)
    with pytest.raises(ConfigError, match="weight_push.transport=object_store"):  # bucketed pushes drain
        load_config(TINY, ["trainer.weight_push.switch=switch-in-flight", "trainer.weight_push.transport=broadcast"])
    with pytest.raises(ConfigError, match="weight_push.switch must be one of"):
        load_config(TINY, ["trainer.weight_push.switch=later"])
