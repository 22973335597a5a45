"""Multi-turn episodes through the plugin's `vllm serve` on CUDA (the 0.25 bundle) with the OpenAI client: the
GPU twin of test_vllm_serve_multiturn.py. 0.25's chat endpoint reads no prompt ids, so later turns go
through /v1/completions with the exact ids as the prompt (recipes/openai_episodes.py picks that route from
the server's version). Each turn ran on the previous prompt + the model's ids + the tool's ids; every model
token's log-prob is the trainer's from one forward over the trajectory (the checkpoint loaded with
`from_pretrained` in bf16 on the GPU); the text round trip ran on other ids.

vLLM's engine core finds the plugin through its entry point: the package must be installed
(`pip install -e . --no-deps`). On a machine without network, the server's own packages come
as wheels: scripts/vllm_server_gpu_wheels.sh.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from rollout_service.tiny_models import tiny_model  # noqa: E402
from rollout_service.vllm.openai_ids import prompt_ids_route  # noqa: E402
from serve_episodes_shared import (assert_exact_ids, assert_trainer_logprobs, run_tool_episode,  # noqa: E402
                                   text_round_trip)
from serve_shared import ROLE_TEMPLATE, running_server, save_merging_tokenizer  # noqa: E402

VOCAB = 2048
MAX_TURNS = 4
CASES = [dict(user="abcfedaabcefab", seed=21, temperature=0.7, top_p=None, max_tokens=24),
         dict(user="fedcbafedd", seed=22, temperature=1.0, top_p=0.9, max_tokens=16),
         dict(user="aebfcd", seed=23, temperature=0.9, top_p=None, max_tokens=32)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from importlib.metadata import entry_points
    plugins = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "rollout_service.vllm.plugin:register" in plugins, \
        "vLLM's engine-core process loads the plugin by its entry point: pip install -e . --no-deps"
    path = str(tmp_path_factory.mktemp("zerokl-multiturn-gpu"))
    tiny_model("qwen2", seed=13, dtype=torch.float32, hidden_size=512, intermediate_size=1536, num_heads=8,
               num_kv_heads=2, num_layers=4, vocab_size=VOCAB, max_positions=1024).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("zerokl-multiturn-gpu-tokenizer")
    save_merging_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def server(checkpoint, tokenizer_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("zerokl-multiturn-gpu-log") / "server.log"
    try:
        with running_server(checkpoint, log_path, "--gpu-memory-utilization", "0.3", "--max-model-len", "1024",
                            "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
                            "--tokenizer", str(tokenizer_dir), "--chat-template", ROLE_TEMPLATE) as base:
            yield base
    except RuntimeError as err:
        pytest.fail(str(err))


def test_served_episodes_keep_exact_ids_and_the_trainers_logprobs(server, checkpoint, tokenizer):
    import transformers
    import vllm
    runs = [(case, *run_tool_episode(server, checkpoint, tokenizer, case, MAX_TURNS)) for case in CASES]
    policy = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda()
    for case, episode, tool, chat in runs:
        assert chat.route == prompt_ids_route(vllm.__version__)
        assert_exact_ids(episode, tool, tokenizer, case, MAX_TURNS)
        assert_trainer_logprobs(policy, episode, case["temperature"])
        # the control: the earlier turns sent back as text run on other ids, and sample apart
        exact, text = episode.served[-1], text_round_trip(chat, case, episode, tool)
        assert text.prompt_ids != exact.prompt_ids, "the text round trip kept the ids: this control cannot fail"
        assert (text.token_ids, text.logprobs) != (exact.token_ids, exact.logprobs)
