"""GRPO recipe pieces without Ray: config, tokenizer/task, seeds, advantages and loss, batches, metrics,
plots, and the cluster-launcher config."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from recipes import tiny_task
from recipes.batch import Sample, pack, split_for_ranks
from recipes.config import load_config
from recipes.config import ConfigError
from recipes.grpo_loss import clipped_pg_loss, group_advantages, rollout_correction
from recipes.metrics import (combine_agreement, length_spread, logprob_agreement, read_metrics, routing_agreement,
                             step_line, wandb_mode)
from recipes.rollouts import (completion_budget, group_requests, prompt_indices, records_routing, rollouts_digest,
                              sample_seed)
from rollout_service.params import Rollout

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "configs" / "tiny.yaml"


def test_config_overrides_and_scientific_numbers():
    cfg = load_config(TINY, ["trainer.optimizer.lr=2e-3", "rollout.determinism=off", "train.steps=3",
                             "rollout.engine.window=2"])
    assert cfg.trainer.optimizer.lr == 2e-3 and isinstance(cfg.trainer.optimizer.lr, float)
    assert cfg.rollout.determinism == "off" and cfg.train.steps == 3
    assert cfg.rollout.engine["window"] == 2 and cfg.rollout.engine["group"] == 8  # merged into the file's
    assert cfg.trainer.num_ranks == 2 and cfg.rollout.num_workers == 2
    with pytest.raises(ValueError, match="rollout.determinism"):
        load_config(TINY, ["rollout.determinism=sometimes"])
    with pytest.raises(ValueError, match="rollout.n"):
        load_config(TINY, ["rollout.n=1"])
    with pytest.raises(ValueError, match="trainer.loss.old_logprobs"):
        load_config(TINY, ["trainer.loss.old_logprobs=fresh"])
    with pytest.raises(ValueError, match="prompts_per_step"):
        load_config(TINY, ["train.prompts_per_step=3", "trainer.batching.mini_batches=2"])
    assert cfg.canonical.tree_segments is None  # the process's width (ZEROKL_TREE_SEGMENTS or 8)
    assert load_config(TINY, ["canonical.tree_segments=4"]).canonical.tree_segments == 4
    for bad in ("3", "true", "eight"):
        with pytest.raises(ValueError, match="canonical.tree_segments"):
            load_config(TINY, [f"canonical.tree_segments={bad}"])


def test_gsm8k_config_parses():
    cfg = load_config(REPO / "recipes" / "configs" / "gsm8k_qwen.yaml")
    assert cfg.task.kind == "gsm8k" and cfg.trainer.device == "cuda"
    assert isinstance(cfg.trainer.optimizer.lr, float)


def test_tiny_tokenizer_is_a_real_fast_tokenizer(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = tiny_task.build_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    ids = tok.encode("12+7=")
    assert len(ids) == 5 and tok.decode(ids) == "12+7="
    assert tok.decode(tok.encode("19") + [tok.eos_token_id], skip_special_tokens=True) == "19"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode("3+4=") == tok.encode("3+4=")


def test_tiny_task_model_vocab_matches_and_reward_is_exact():
    from recipes.models import initial_model
    from recipes.task import build_task

    cfg = load_config(TINY)
    task = build_task(cfg)
    model = initial_model(cfg, task.tokenizer)
    assert model.config.vocab_size == len(task.tokenizer)
    assert len(task.dataset) == 20 * 20 and set(task.dataset.column_names) >= {"prompt_ids", "answer"}
    row = task.dataset[0]
    a, b = task.tokenizer.decode(row["prompt_ids"]).rstrip("=").split("+")
    right = task.tokenizer.encode(str(int(a) + int(b))) + [task.stop_token_ids[0]]
    assert task.reward(right, row["answer"]) == 1.0
    assert task.reward(task.tokenizer.encode(str(int(a) + int(b) + 1)), row["answer"]) == 0.0


def test_seeds_and_prompt_order_are_pure_functions():
    assert sample_seed(0, 1, 2, 3) == sample_seed(0, 1, 2, 3)
    seeds = {sample_seed(s, st, p, j) for s in range(2) for st in range(3) for p in range(4) for j in range(4)}
    assert len(seeds) == 2 * 3 * 4 * 4 and all(0 <= x < 2 ** 63 for x in seeds)
    first = prompt_indices(0, 10, 10, run_seed=0)
    assert sorted(first) == list(range(10))  # one epoch = a permutation
    assert prompt_indices(5, 10, 10, 0)[:5] == first[5:]  # a cursor continues the same sequence
    assert prompt_indices(10, 10, 10, 0) != first  # the next epoch is reshuffled


def test_group_requests_one_seed_per_sample():
    rollout = load_config(TINY, ["rollout.n=3", "rollout.max_tokens=5"]).rollout
    prompts, params = group_requests([[3, 4], [5]], [7, 9], step=2, rollout=rollout, run_seed=0, stop_token_ids=(1,))
    assert len(prompts) == 2 * 3 and prompts[0] == [3, 4] and prompts[3] == [5]
    assert params[1].seed == sample_seed(0, 2, 7, 1) and params[3].seed == sample_seed(0, 2, 9, 0)
    assert params[0].stop_token_ids == (1,) and params[0].determinism == rollout.determinism
    assert all(p.max_tokens == 5 for p in params)


def test_completion_budgets_are_pure_functions_of_their_key():
    draw = [completion_budget(0, 1, p, j, "lognormal", 4096, 1024, 0.7) for p in range(8) for j in range(8)]
    assert draw == [completion_budget(0, 1, p, j, "lognormal", 4096, 1024, 0.7) for p in range(8) for j in range(8)]
    assert len(set(draw)) > 32  # they differ from request to request
    for seed, step in ((1, 1), (0, 2)):  # another run seed, another step: other draws
        assert draw != [completion_budget(seed, step, p, j, "lognormal", 4096, 1024, 0.7) for p in range(8)
                        for j in range(8)]
    assert completion_budget(0, 1, 2, 3, "fixed", 16) == 16  # fixed: every request rollout.max_tokens
    with pytest.raises(ValueError, match="length distribution"):
        completion_budget(0, 1, 2, 3, "uniform", 16)


def test_completion_budgets_follow_the_lognormal_capped_and_at_least_one():
    import math
    import statistics

    draws = [completion_budget(7, s, p, 0, "lognormal", 4096, 1024, 0.7) for s in range(40) for p in range(100)]
    assert all(isinstance(n, int) and 1 <= n <= 4096 for n in draws)
    assert abs(statistics.median(draws) - 1024) < 0.05 * 1024
    logs = [math.log(n) for n in draws if n < 4096]  # the log-space spread, below the cap
    assert 0.6 < statistics.pstdev(logs) < 0.75
    assert 0 < sum(n == 4096 for n in draws) / len(draws) < 0.05  # P(z > ln 4 / 0.7) = 2.4%: clipped to the cap
    tiny = [completion_budget(0, 1, p, 0, "lognormal", 8, 1, 3.0) for p in range(200)]
    assert min(tiny) == 1 and max(tiny) == 8  # clipped at both ends
    assert {completion_budget(0, 1, p, 0, "lognormal", 64, 10, 0.0) for p in range(20)} == {10}  # sigma 0


def test_length_settings_are_checked():
    cfg = load_config(TINY, ["rollout.length_distribution=lognormal", "rollout.length_median=3",
                             "rollout.max_tokens=12", "rollout.length_sigma=1"])
    assert cfg.rollout.length_sigma == 1.0 and cfg.rollout.length_median == 3
    assert load_config(TINY).rollout.length_distribution == "fixed"
    with pytest.raises(ValueError, match="rollout.length_distribution"):
        load_config(TINY, ["rollout.length_distribution=uniform"])
    for bad in (["rollout.length_median=13"], [], ["rollout.length_median=0"]):
        with pytest.raises(ValueError, match="rollout.length_median"):
            load_config(TINY, ["rollout.length_distribution=lognormal", "rollout.max_tokens=12", *bad])
    with pytest.raises(ValueError, match="rollout.length_sigma"):
        load_config(TINY, ["rollout.length_distribution=lognormal", "rollout.length_median=3",
                           "rollout.length_sigma=-0.1"])


def test_group_requests_carry_each_requests_drawn_max_tokens():
    lognormal = ["rollout.n=4", "rollout.max_tokens=64", "rollout.length_distribution=lognormal",
                 "rollout.length_median=16", "rollout.length_sigma=0.8"]
    rollout = load_config(TINY, lognormal).rollout
    _, params = group_requests([[3, 4], [5]], [7, 9], step=2, rollout=rollout, run_seed=5, stop_token_ids=(1,))
    budgets = [p.max_tokens for p in params]
    assert budgets == [completion_budget(5, 2, index, j, "lognormal", 64, 16, 0.8) for index in (7, 9)
                       for j in range(4)]
    assert len(set(budgets)) > 1
    _, again = group_requests([[3, 4], [5]], [7, 9], step=2, rollout=rollout, run_seed=5, stop_token_ids=(1,))
    assert [p.max_tokens for p in again] == budgets  # a resumed run sends the same requests
    fixed = load_config(TINY, ["rollout.n=4", "rollout.max_tokens=64"]).rollout
    _, params = group_requests([[3, 4], [5]], [7, 9], step=2, rollout=fixed, run_seed=5, stop_token_ids=(1,))
    assert [p.max_tokens for p in params] == [64] * 8


def test_length_spread_of_a_step():
    assert length_spread([3, 10, 1, 7]) == {"response/length_median": 5.0, "response/length_min": 1,
                                            "response/length_max": 10}


def test_group_requests_ask_for_routing_of_moe_policies():
    from rollout_service.engine.protocol import EngineCapabilities
    from rollout_service.tiny_models import tiny_model

    records = EngineCapabilities(switch_modes=True, routing_records=True, bucketed_push=True, sleep=False)
    cannot = dataclasses.replace(records, routing_records=False)  # vLLM, TP groups
    rollout = load_config(TINY).rollout
    assert records_routing(rollout, tiny_model("qwen3_moe"), records)
    assert not records_routing(rollout, tiny_model("qwen2"), records)
    assert not records_routing(rollout, tiny_model("qwen3_moe"), cannot)  # null: where every worker can
    off = load_config(TINY, ["rollout.return_routed_experts=false"]).rollout
    assert not records_routing(off, tiny_model("qwen3_moe"), records)
    asked = load_config(TINY, ["rollout.return_routed_experts=true"]).rollout
    assert records_routing(asked, tiny_model("qwen3_moe"), cannot)  # asked: the workers refuse it themselves
    assert not EngineCapabilities.common([records, cannot]).routing_records
    assert EngineCapabilities.common([records, records]) == records
    _, params = group_requests([[3, 4]], [7], step=1, rollout=rollout, run_seed=0, stop_token_ids=(1,),
                               routed_experts=True)
    assert all(p.return_routed_experts for p in params)
    _, params = group_requests([[3, 4]], [7], step=1, rollout=rollout, run_seed=0, stop_token_ids=(1,))
    assert not any(p.return_routed_experts for p in params)


def test_group_advantages():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))
    centred = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), scale=False)
    assert torch.allclose(centred, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_clipped_loss_matches_the_ppo_surrogate():
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -0.1]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, clipped = clipped_pg_loss(logp, old, adv, mask, 0.2, 0.2)
    ratio = torch.exp(logp.detach() - old)
    # token (0,1): ratio e^0.5 > 1.2 with A > 0 -> clipped at 1.2; token (1,0): ratio e^-1 < 0.8 with A < 0 -> clipped
    expect = -(1.0 * ratio[0, 0]) - 1.2 * 1.0 + 0.8 * 1.0
    assert torch.allclose(loss, expect) and clipped.item() == 2
    loss.backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0 and logp.grad[1, 0] == 0 and logp.grad[1, 1] == 0


def test_rollout_corrections_weigh_tokens_by_the_trainer_over_rollout_ratio():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.9]]))  # ratios 1, 5, 1.25, 0.556
    ratio = torch.exp(old - rollout)
    assert rollout_correction("none", old, rollout, 2.0) is None
    assert torch.equal(rollout_correction("tis", old, rollout, 2.0), ratio.clamp(max=2.0))
    assert rollout_correction("token_mask", old, rollout, 2.0).tolist() == [[1.0, 0.0, 1.0, 1.0]]
    assert rollout_correction("token_mask", old, rollout, 1.5).tolist() == [[1.0, 0.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="rollout correction"):
        rollout_correction("mis", old, rollout, 2.0)


def test_rollout_corrections_scale_each_tokens_surrogate_and_its_gradient():
    logp = torch.tensor([[-1.0, -0.5, -0.7]], requires_grad=True)
    old, adv, mask = logp.detach().clone(), torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool)
    weights = torch.tensor([[2.0, 0.0, 0.5]])
    loss, _ = clipped_pg_loss(logp, old, adv, mask, 0.2, 0.2, weights)
    assert torch.allclose(loss, torch.tensor(-(2.0 + 0.0 + 0.5)))  # ratio 1 on every token
    loss.backward()
    assert torch.allclose(logp.grad, -weights)  # d(-A r w)/d logp = -A r w at r = 1
    # the rollout's log-probs equal to the trainer's (canonical numerics): every correction leaves the loss's bits
    plain, _ = clipped_pg_loss(logp.detach(), old, adv, mask, 0.2, 0.2)
    for kind in ("tis", "token_mask"):
        corrected, _ = clipped_pg_loss(logp.detach(), old, adv, mask, 0.2, 0.2, rollout_correction(kind, old, old, 2.0))
        assert torch.equal(corrected, plain), kind


def test_rollout_correction_settings_are_checked():
    stock = ["numerics=stock", "rollout.determinism=off", "trainer.loss.old_logprobs=recompute"]
    assert load_config(TINY, [*stock, "trainer.loss.rollout_correction=tis"]).trainer.loss.rollout_correction == "tis"
    for bad, message in ((["trainer.loss.rollout_correction=tis"], "old_logprobs=recompute"),
                         ([*stock, "trainer.loss.rollout_correction=is"], "rollout_correction"),
                         ([*stock, "trainer.loss.rollout_correction=tis", "trainer.loss.rollout_correction_cap=1"],
                          "rollout_correction_cap")):
        with pytest.raises(ConfigError, match=message):
            load_config(TINY, bad)


def test_pack_aligns_with_token_logprobs():
    from rollout_service.tiny_models import tiny_model
    from trainer_patch import token_logprobs

    model = tiny_model("qwen2", vocab_size=24, max_positions=64)
    samples = [Sample([1, 2, 3], [4, 5], [0.0, 0.0], 0.5), Sample([6], [7, 8, 9], [0.0, 0.0, 0.0], -0.5)]
    batch = pack(samples)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert batch["loss_mask"].tolist() == [[False, False, True, True], [True, True, True, False]]
    lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    for i, s in enumerate(samples):
        alone = token_logprobs(model, torch.tensor([s.prompt_ids + s.token_ids]))[0, len(s.prompt_ids) - 1:]
        assert torch.equal(lp[i][batch["loss_mask"][i]], alone)


def test_pack_aligns_routed_experts_with_token_logprobs():
    """Rollout routing [token][layer][k] lands at the row that scores the token (t-1 for token t), -1
    elsewhere, which is where token_logprobs(routing=...) puts the trainer's."""
    from rollout_service.tiny_models import tiny_model
    from trainer_patch import token_logprobs

    model = tiny_model("qwen3_moe", vocab_size=24, max_positions=64)
    seqs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9])]
    routing = []
    for prompt, tokens in seqs:  # each sequence alone: the routing it would have recorded
        layers = []
        token_logprobs(model, torch.tensor([prompt + tokens]), routing=layers)
        rows = torch.stack(layers, dim=2)[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        routing.append(rows.tolist())
    samples = [Sample(p, t, [0.0] * len(t), 0.0, r) for (p, t), r in zip(seqs, routing)]
    batch = pack(samples)
    experts = batch["rollout_routed_experts"]
    assert experts.shape == (2, 4, 2, 2) and experts.dtype == torch.int16
    assert bool((experts[~batch["loss_mask"]] == -1).all())
    layers = []
    token_logprobs(model, batch["input_ids"], batch["attention_mask"], routing=layers)
    train = torch.stack(layers, dim=2)[:, :-1]
    assert routing_agreement(experts, train, batch["loss_mask"]) == {"routing_decisions": 5 * 2,
                                                                     "routing_mismatches": 0}
    assert "rollout_routed_experts" not in pack([Sample([1], [2], [0.0], 0.0)])  # dense rollouts
    assert "rollout_routed_experts" not in pack([])  # a rank's dummy row
    with pytest.raises(ValueError, match="some samples carry routed experts"):
        pack(samples[:1] + [Sample([1], [2], [0.0], 0.0)])


def test_split_for_ranks_keeps_collectives_paired():
    samples = [Sample([1], [2] * (i + 1), [0.0] * (i + 1), 0.0) for i in range(5)]
    plans, tokens = split_for_ranks(samples, world=2, mini_batches=1, micro_batch_size=2)
    assert tokens == [15]
    assert [len(p[0]) for p in plans] == [2, 2]  # same micro-batch count on both ranks
    rows = sorted(int(mb["loss_mask"].sum()) for p in plans for mb in p[0])
    assert sum(rows) == 15
    plans, _ = split_for_ranks(samples[:1], world=2, mini_batches=1)
    assert int(plans[1][0][0]["loss_mask"].sum()) == 0  # an empty rank runs a masked dummy row


def test_agreement_metrics():
    a = torch.tensor([[-1.0, -2.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    zero = combine_agreement([logprob_agreement(a, a.clone(), mask)])
    assert zero["rollout_train/kl"] == 0.0 and zero["rollout_train/kl_k3"] == 0.0
    assert zero["rollout_train/max_abs_logprob_diff"] == 0.0 and zero["rollout_train/mismatched_tokens"] == 0
    b = a + torch.tensor([[0.1, 0.0, 5.0]])
    m = combine_agreement([logprob_agreement(a, b, mask), logprob_agreement(a, a, mask)])
    assert m["rollout_train/tokens"] == 4 and m["rollout_train/mismatched_tokens"] == 1
    assert m["rollout_train/kl"] == pytest.approx(-0.1 / 4, rel=1e-5)
    assert m["rollout_train/max_abs_logprob_diff"] == pytest.approx(0.1, rel=1e-5)
    assert m["rollout_train/kl_k3"] == pytest.approx((torch.tensor(0.1).exp() - 1 - 0.1).item() / 4, rel=1e-4)


def test_routing_agreement_metrics():
    """Decisions are (token, layer) pairs over the loss mask; one differing expert id makes the pair
    a mismatch. Dense runs (no part measured routing) log no routing metrics."""
    mask = torch.tensor([[True, True, False]])
    rollout = torch.tensor([[[[0, 3], [1, 2]], [[4, 5], [0, 7]], [[-1, -1], [-1, -1]]]], dtype=torch.int16)
    same = routing_agreement(rollout, rollout.long(), mask)
    assert same == {"routing_decisions": 4, "routing_mismatches": 0}
    flipped = rollout.long().clone()
    flipped[0, 1, 1] = torch.tensor([0, 6])  # token 1, layer 1: expert 7 -> 6
    flipped[0, 2, 0] = torch.tensor([1, 2])  # outside the mask: not counted
    one = routing_agreement(rollout, flipped, mask)
    assert one == {"routing_decisions": 4, "routing_mismatches": 1}
    a = torch.tensor([[-1.0, -2.0, 0.0]])
    parts = [{**logprob_agreement(a, a, mask), **same}, {**logprob_agreement(a, a, mask), **one}]
    m = combine_agreement(parts + [logprob_agreement(a, a, mask)])  # + a dummy row's part: no routing
    assert m["rollout_train/routing_agreement"] == 7 / 8 and m["rollout_train/routing_mismatches"] == 1
    assert combine_agreement(parts[:1])["rollout_train/routing_agreement"] == 1.0
    dense = combine_agreement([logprob_agreement(a, a, mask)])
    assert not any("routing" in k for k in dense)
    with pytest.raises(ValueError, match="routing"):
        routing_agreement(rollout, flipped[:, :, :1], mask)
    line = {"reward/mean": 0.5, "perf/step_s": 1.0, "perf/rollout_s": 0.5, "perf/train_s": 0.3,
            "perf/weight_sync_s": 0.1, **dense}
    assert "routing" not in step_line(line)
    assert "routing 87.50% (1 differ)" in step_line({**line, **m})


def test_rollouts_digest_sees_every_bit():
    r = [Rollout([1, 2], [3], [-0.5], "stop")]
    r2 = [Rollout([1, 2], [3], [-0.5000000000000001], "stop")]
    assert rollouts_digest(r) == rollouts_digest(copy.deepcopy(r)) != rollouts_digest(r2)
    routed = [Rollout([1, 2], [3], [-0.5], "stop", routed_experts=[[[0, 1]]])]
    flipped = [Rollout([1, 2], [3], [-0.5], "stop", routed_experts=[[[0, 2]]])]
    assert len({rollouts_digest(r), rollouts_digest(routed), rollouts_digest(flipped)}) == 3


def test_wandb_mode(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled" and wandb_mode("offline") == "offline"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")
    monkeypatch.setenv("HOME", "/nonexistent")
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"


def test_plot_renders_png(tmp_path):
    from recipes.plot import main as plot_main

    for name, kl in (("run", 0.0), ("base", 1e-3)):
        d = tmp_path / name
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            for step in range(1, 4):
                f.write(json.dumps({"step": step, "rollout_train/kl": kl, "rollout_train/max_abs_logprob_diff": kl,
                                    "reward/mean": 0.1 * step}) + "\n")
    out = tmp_path / "curves.png"
    plot_main([str(tmp_path / "run"), "--baseline", str(tmp_path / "base"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def _fake_run(run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout_train/kl": 0.0, "reward/mean": 0.5}) + "\n")
    return run_dir


def test_plot_takes_a_run_name_under_the_default_or_a_configs_output_dir(tmp_path, monkeypatch):
    from recipes.plot import main as plot_main

    monkeypatch.setenv("HOME", str(tmp_path))  # the default output_dir is ~/zerokl-runs
    run = _fake_run(tmp_path / "zerokl-runs" / "grpo-verified-20260101-000000-abc123")
    plot_main([run.name])
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    elsewhere = _fake_run(tmp_path / "elsewhere" / "mine-off-1")
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {elsewhere.parent}\n")
    plot_main([elsewhere.name, "--config", str(config), "--baseline", str(run), "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").is_file()


def test_plot_of_an_unknown_run_names_close_matches(tmp_path, monkeypatch, capsys):
    from recipes.plot import main as plot_main

    monkeypatch.setenv("HOME", str(tmp_path))
    _fake_run(tmp_path / "zerokl-runs" / "grpo-verified-20260101-000000-abc123")
    _fake_run(tmp_path / "zerokl-runs" / "grpo-off-20260101-000000-def456")
    with pytest.raises(SystemExit) as exit_:
        plot_main(["grpo-verified-20260101-000000-abc124"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no run 'grpo-verified-20260101-000000-abc124'" in err and str(tmp_path / "zerokl-runs") in err
    assert "grpo-verified-20260101-000000-abc123" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        plot_main(["grpo-off"])  # a prefix of one run's name: offered, not guessed
    assert "grpo-off-20260101-000000-def456" in capsys.readouterr().err


def test_ray_cluster_yaml_passes_ray_validation():
    jsonschema = pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    assert any(t.get("resources", {}).get("GPU", 0) >= 1 for t in types.values())
    assert any("pip install" in c and "zerokl" in c for c in cfg["setup_commands"])
    broken = copy.deepcopy(raw)
    broken["available_node_types"]["gpu_worker"]["not_a_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_a_rank_outside_ray_reports_no_gpus_and_needs_no_ray(monkeypatch):
    """A trainer rank run in-process (tests, notebooks, the GPU image without Ray) sets up without Ray:
    with Ray missing, or present but not started, it has no placement to report."""
    import sys

    from rollout_service.service.ray_cluster import actor_gpu_ids

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError inside this block
        assert actor_gpu_ids() == []
    import ray
    if ray.is_initialized():
        ray.shutdown()
    assert actor_gpu_ids() == []


def test_train_device_metrics_sum_the_ranks_allocator_counts():
    from recipes.metrics import train_device_metrics
    ranks = [{"peak_memory_bytes": 2 ** 30, "tokens": 1000, "num_params": 10 ** 9, "device_allocs": 7,
              "alloc_retries": 1},
             {"peak_memory_bytes": 2 ** 31, "tokens": 1000, "num_params": 10 ** 9, "device_allocs": 5,
              "alloc_retries": 0}]
    got = train_device_metrics(ranks, 2.0)
    assert got["perf/train_device_allocs"] == 12 and got["perf/train_alloc_retries"] == 1
    assert got["perf/train_peak_memory_gib"] == 2.0
    assert got["perf/train_mfu"] == pytest.approx(6 * 10 ** 9 * 2000 / 2.0 / (790e12 * 2))
    assert train_device_metrics([{"tokens": 1000, "num_params": 10 ** 9}], 2.0) == {}  # CPU ranks: none


def test_the_set_up_line_gives_each_part_its_own_seconds(monkeypatch, capsys):
    """The run's set-up line splits its seconds at each mark: the checks and placement, the starting model,
    the rollout pool, and the trainer ranks until now, so a slow part of a GPU run's set-up shows by name."""
    from types import SimpleNamespace

    from recipes import grpo_job
    monkeypatch.setattr(grpo_job.time, "perf_counter", lambda: 100.0)
    job = SimpleNamespace(run_dir="runs/x", gpus={"rollout": [], "trainer": []})
    grpo_job._say_ready(job, (40.0, 43.0, 50.0, 80.0))
    assert capsys.readouterr().out.strip() == (
        "run directory runs/x; set up in 60s (task, memory check and placement 3s, model 7s, rollout pool 30s, "
        "trainer ranks 20s)")
