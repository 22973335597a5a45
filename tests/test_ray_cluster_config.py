"""The cluster launcher configs (ray_cluster.yaml: AWS; ray_cluster_local.yaml: on-premise hosts) pass Ray's own
validation, as `ray up` runs it (prepare_config, then validate_config against Ray's schema), and what they promise
holds: the package extras they install exist, and the recipe their comments submit fits on one of their nodes."""
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from recipes.config import load_config
from recipes.placement import placement_bundles

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["ray_cluster.yaml", "ray_cluster_local.yaml"]


def _read(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_accepts_the_cluster_config(name):
    validate_config(prepare_config(_read(name)))


def test_the_validation_refuses_a_misspelt_key():
    """The control: a key Ray does not know (max_worker for max_workers) fails the same validation."""
    config = _read("ray_cluster.yaml")
    config["max_worker"] = config.pop("max_workers")
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(config))


def test_the_on_premise_config_lists_its_hosts():
    prepared = prepare_config(_read("ray_cluster_local.yaml"))
    hosts = prepared["provider"]["worker_ips"]
    assert prepared["provider"]["head_ip"] not in hosts and len(set(hosts)) == len(hosts) >= 2
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(hosts)  # every listed host joins


@pytest.mark.parametrize("name", CONFIGS)
def test_the_configs_install_extras_that_exist(name):
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = [re.search(r'pip install -e "\$HOME/zerokl\[([^\]]*)\]"', c) for c in _read(name)["setup_commands"]]
    asked = {e for m in installs if m for e in m.group(1).split(",")}
    assert asked and asked <= extras, (asked, extras)
    assert "vllm" in asked  # the rollout workers' engines


def test_the_submitted_recipe_fits_on_one_gpu_node():
    """ray_cluster.yaml's comment submits a recipe config: its placement's bundles fit on one GPU node (the
    head offers no CPU, so nothing lands there)."""
    text = (ROOT / "ray_cluster.yaml").read_text()
    (recipe,) = set(re.findall(r"--config (\S+)", text))
    bundles = placement_bundles(load_config(ROOT / recipe))
    config = _read("ray_cluster.yaml")
    nodes = config["available_node_types"]
    assert nodes[config["head_node_type"]]["resources"] == {"CPU": 0}
    gpu_node = next(n["resources"] for n in nodes.values() if n["resources"].get("GPU"))
    for key in ("CPU", "GPU"):
        assert sum(b.get(key, 0) for b in bundles) <= gpu_node[key], (key, bundles, gpu_node)
