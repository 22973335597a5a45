"""Ray's own multi-node test cluster (ray.cluster_utils.Cluster) for the multi-node tests: a head and a few
nodes on this machine, each a raylet of its own with its own resources, joined by this driver.

Every node is a real raylet: removing one kills its processes (workers, actors, object store) the way a
lost machine would. Nodes are told apart by a custom resource named after them (`node:<name>` is Ray's
own, so ours is `zerokl_node_<name>`), which is also how a config places something on a given node.
"""
from __future__ import annotations

import contextlib
import os

import ray


def node_resource(name: str) -> str:
    """The custom resource that node `name` offers one unit of (placement by node, in a config)."""
    return f"zerokl_node_{name}"


class TestCluster:
    """A head (the driver's node) and named nodes; `add(name, cpus, resources)` and `remove(name)` change it
    while it runs. `address` is what a second driver or `ray job submit` joins (the GCS address)."""

    __test__ = False  # not a pytest class

    def __init__(self, head_cpus: int = 1, head_resources: dict | None = None, dashboard: bool = False,
                 head_args: dict | None = None):
        """head_args: more of the head's node arguments (Ray's RayParams), e.g. dashboard_agent_listen_port."""
        from ray.cluster_utils import Cluster
        self.nodes: dict = {}
        self._cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "resources": {node_resource("head"): 1, **(head_resources or {})},
            "include_dashboard": dashboard, **(head_args or {})})
        self.address = self._cluster.address
        self.head = self._cluster.head_node

    @property
    def dashboard_url(self) -> str:
        """http://host:port of the head's dashboard, which `ray job submit --address` takes (dashboard=True)."""
        url = self.head.address_info["webui_url"]
        return url if url.startswith("http") else f"http://{url}"

    def add(self, name: str, cpus: int = 2, resources: dict | None = None, **node_args):
        """A node named `name` with `cpus` CPUs, `resources` and one unit of node_resource(name)."""
        node = self._cluster.add_node(num_cpus=cpus, resources={node_resource(name): 1, **(resources or {})},
                                      **node_args)
        self.nodes[name] = node
        self._cluster.wait_for_nodes()
        return node

    def remove(self, name: str) -> None:
        """Kill node `name` as a lost machine would (its raylet and every process on it)."""
        self._cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def lose(self, name: str) -> None:
        """Lose node `name` as a machine that loses power would: its raylet and every process it started (its
        actors' workers among them) get SIGKILL at once, so none finishes a call or says goodbye. `remove`
        kills the raylet alone, and its workers outlive it long enough to answer calls already made."""
        import signal

        import psutil
        from ray._private import ray_constants
        node = self.nodes[name]
        raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        for process in [raylet, *raylet.children(recursive=True)]:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.remove(name)

    def name_of(self, node_id: str) -> str:
        """The name of the node whose Ray node id is `node_id` ("head" for the head)."""
        if node_id == self.head.node_id:
            return "head"
        return next(name for name, node in self.nodes.items() if node.node_id == node_id)

    def node_id(self, name: str) -> str:
        return (self.head if name == "head" else self.nodes[name]).node_id

    def shutdown(self) -> None:
        self._cluster.shutdown()


def node_of_actor(actor) -> str:
    """The Ray node id an actor runs on (as the actor reports it)."""
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


@contextlib.contextmanager
def joined(cluster: TestCluster, **init_args):
    """This driver joined to `cluster` (any Ray this process had is shut down first), left on exit."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address, log_to_driver=False, **init_args)
    try:
        yield cluster
    finally:
        ray.shutdown()


@contextlib.contextmanager
def test_cluster(nodes: dict[str, dict], head_cpus: int = 1, dashboard: bool = False, head_args: dict | None = None):
    """A running TestCluster with `nodes` (name -> add()'s keywords) and this driver joined to it; RAY_ADDRESS
    points at it inside the block, so subprocesses (a second driver) find it too. head_args: TestCluster's."""
    cluster = TestCluster(head_cpus=head_cpus, dashboard=dashboard, head_args=head_args)
    before = os.environ.get("RAY_ADDRESS")
    try:
        for name, args in nodes.items():
            cluster.add(name, **args)
        os.environ["RAY_ADDRESS"] = cluster.address
        with joined(cluster):
            yield cluster
    finally:
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before
        cluster.shutdown()


test_cluster.__test__ = False


def free_port() -> int:
    """A TCP port free on this machine now (for a head's dashboard ports: several clusters on one machine
    would otherwise race for Ray's fixed defaults, and the loser's job agent serves no HTTP)."""
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def apart_head_args(temp_dir: str, dashboard: bool = False) -> dict:
    """TestCluster head_args that keep a cluster apart from other Ray clusters on this machine, as separate
    machines are: a Ray temp directory of its own (`temp_dir`, short and absolute: Ray's socket paths live
    under it; a submitted job's driver joins the cluster its temp directory names last) and a dashboard
    agent port of its own, with the dashboard's too (several clusters race for Ray's fixed defaults, and the
    loser's job agent serves no HTTP: "No available agent to submit job")."""
    args = {"temp_dir": temp_dir, "dashboard_agent_listen_port": free_port()}
    return {**args, "dashboard_port": free_port()} if dashboard else args


def apart_node_args(name: str) -> dict:
    """add() keywords that give node `name` a runtime-env directory of its own, as a separate machine has:
    nodes that share one Ray session directory unpack a job's working directory into the same place, and a
    node that installs it deletes the copy another node's driver is running in (Ray's "Local directory ...
    does not exist on the cluster", or a driver whose working directory vanished)."""
    return {"runtime_env_dir_name": f"runtime_resources_{name}"}
