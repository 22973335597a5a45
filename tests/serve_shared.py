"""Helpers shared by the `vllm serve` tests on CPU (test_vllm_serve.py) and GPU
(gpu/test_vllm_serve_gpu.py): start the plugin's server on 127.0.0.1, call it, stop it."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollout_service.vllm.plugin.serve import cpu_sizing, serve_argv

STARTUP_S = 300
REQUEST_S = 120
REPO = Path(__file__).resolve().parents[1]


def save_word_tokenizer(path, vocab: int) -> None:
    """A word-level tokenizer over the model's ids: with a tokenizer vLLM rejects out-of-vocabulary ids
    (400); with --skip-tokenizer-init it skips that check and the engine dies on the embedding lookup."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab - 1)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    # transformers loads it as Qwen2's tokenizer, which appends <|endoftext|>: `vocab` ids in all
    loaded = AutoTokenizer.from_pretrained(path)
    assert max(loaded.get_vocab().values()) == vocab - 1, loaded.get_vocab()


def save_text_tokenizer(path, vocab: int) -> None:
    """A word-level tokenizer over every id ("t<i>" is id i) in a directory of its own, for `--tokenizer`:
    text (a chat template's output) then becomes ids. Beside a Qwen2 config transformers would load any
    tokenizer as Qwen2's byte-level BPE, which turns these words into no ids at all."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    assert AutoTokenizer.from_pretrained(path)("t5 t6 ")["input_ids"] == [5, 6]


ROLE_SPECIALS = ("<|end|>", "<|user|>", "<|assistant|>", "<|tool|>")  # ids 0-3; <|end|> is the EOS
ROLE_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_merging_tokenizer(path, vocab: int, alphabet: str = "abcdef") -> None:
    """A BPE tokenizer over exactly `vocab` ids, in a directory of its own (for `--tokenizer`): the role
    tokens of ROLE_TEMPLATE, the letters of `alphabet`, then every string of them by length, each a
    merge of a shorter one and a letter. Decoding concatenates; encoding merges any two adjacent
    letters, so text decoded from sampled ids rarely encodes to the same ids (the text round trip that
    multi-turn clients must not make)."""
    import itertools
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tokens, merges, level = [*ROLE_SPECIALS, *alphabet], [], list(alphabet)
    while len(tokens) < vocab:
        longer = []
        for stem, letter in itertools.product(level, alphabet):
            if len(tokens) == vocab:
                break
            merges.append((stem, letter))
            tokens.append(stem + letter)
            longer.append(stem + letter)
        level = longer
    core = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ROLE_SPECIALS])
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token=ROLE_SPECIALS[0]).save_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)
    assert len(loaded) == vocab and loaded.eos_token_id == 0, (len(loaded), loaded.eos_token_id)
    pair = alphabet[:2]  # two letters' ids decode to their text, which encodes to one id
    assert loaded(loaded.decode(loaded.convert_tokens_to_ids(list(pair))))["input_ids"] == \
        [loaded.convert_tokens_to_ids(pair)]


def serve_checkpoint(tmp_path_factory, name: str, vocab: int, **model_kw) -> str:
    """A tiny Qwen2 checkpoint with a word tokenizer over its ids, for a server's tests."""
    from rollout_service.tiny_models import tiny_model
    path = str(tmp_path_factory.mktemp(name))
    tiny_model("qwen2", seed=7, **model_kw).save_pretrained(path)
    save_word_tokenizer(path, vocab)
    return path


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url, body=None, timeout=REQUEST_S):
    """(status, parsed JSON) of a GET (body None) or JSON POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def _stop(proc):
    """The server and its engine / worker processes (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@contextlib.contextmanager
def running_server(checkpoint, log_path, *vllm_args, plugin: bool = True):
    """The plugin's `vllm serve` (plugin=False: vLLM's own server, the same sizing) on a free local port,
    healthy; yields its base URL. Raises RuntimeError with the log's tail if it exits or is not healthy
    within STARTUP_S."""
    port = _free_port()
    args = ("--host", "127.0.0.1", "--port", str(port), "--seed", "0", *vllm_args)
    argv = serve_argv(checkpoint, *args) if plugin else [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--dtype", "bfloat16",
        *cpu_sizing(args), *args]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # set by other tests
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{Path(log_path).read_text()[-4000:]}")
            try:
                if call(base + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {STARTUP_S} s:\n{Path(log_path).read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        _stop(proc)


def complete(base, prompt, max_tokens, **xargs):
    """(tokens, log-probs) of one /v1/completions request with our params in vllm_xargs."""
    status, body = call(base + "/v1/completions", dict(
        prompt=list(prompt), max_tokens=max_tokens, logprobs=0, return_token_ids=True, ignore_eos=True,
        vllm_xargs={f"zerokl_{k}": v for k, v in xargs.items()}))
    assert status == 200, body
    choice = body["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def complete_all(base, prompts, params):
    """Concurrent requests (vLLM batches them), one per prompt, with native SamplingParams' seeds;
    top_k / top_p travel where a request sets them."""
    def one(args):
        prompt, p = args
        extra = {}
        if p.top_k != -1:
            extra["top_k"] = p.top_k
        if p.top_p != 1.0:
            extra["top_p"] = p.top_p
        return complete(base, prompt, p.max_tokens, temperature=p.temperature, seed=p.effective_seed, **extra)
    with ThreadPoolExecutor(min(len(prompts), 64)) as pool:
        return list(pool.map(one, zip(prompts, params)))
