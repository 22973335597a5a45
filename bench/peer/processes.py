"""Each system (or an interleaved group) in a process of its own, supervised: killed with its children
when it ends, at its timeout, or when it hangs in teardown after its result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from bench.peer.systems import INTERLEAVED, TEARDOWN_GRACE_S

# the script each system's process runs, with --worker
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peer_vllm.py")


def run_process(args, system: str) -> dict:
    """One system in its own process group, which is killed when the system ends (vLLM's engine-core
    and worker processes must not outlive it: the next system's memory profiling would see their memory
    come back). With --out, the process's output is kept in `<out>.<system>.log`; a failed system's
    result names the error lines of that output (vLLM's "see root cause above"). A process that has
    printed its result but not exited within TEARDOWN_GRACE_S is killed: its figures stand, and its
    result's `teardown` says so."""
    env = dict(os.environ)
    env.pop("VLLM_BATCH_INVARIANT", None)
    if system == "vllm-batch-invariant":
        env["VLLM_BATCH_INVARIANT"] = "1"
    cmd = [sys.executable, PEER_SCRIPT, "--worker", system, "--timeout", str(args.timeout)]
    cmd += args.passthrough
    start = time.perf_counter()
    output, stopped, returncode = supervise(cmd, env, args.timeout)
    wall = round(time.perf_counter() - start, 1)
    if args.out:
        name = "interleaved" if system.startswith(INTERLEAVED) else system
        with open(f"{os.path.splitext(args.out)[0]}.{name}.log", "w") as f:
            f.write(output)
    result = next((json.loads(line[len("RESULT "):]) for line in output.splitlines()
                   if line.startswith("RESULT ")), None)
    if result is None:
        result = dict(error=stopped or f"exit {returncode}")
    elif stopped:  # measured, then stuck in teardown: the figures stand, the hang is reported
        result["teardown"] = stopped
    if "error" in result:
        result["causes"] = error_lines(output)
    result["process_wall_s"] = wall
    return result


def process_results(args, group: list[str]) -> dict[str, dict]:
    """Each system's result from one process: a system's own, or a group's under --interleave (a
    process that failed gives each system its error)."""
    if not args.interleave:
        return {group[0]: run_process(args, group[0])}
    res = run_process(args, INTERLEAVED + ",".join(group))
    return {system: dict(res[system], process_wall_s=res["process_wall_s"]) if system in res else res
            for system in group}


def supervise(cmd: list[str], env: dict, timeout: float, grace: float = TEARDOWN_GRACE_S):
    """Runs cmd in a process group of its own and kills the group when it ends, at `timeout`, or
    `grace` seconds after a RESULT line (a process stuck in teardown after measuring). Returns
    (output, why it was stopped or None, exit code or None)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, result_at = [], []

    def read():  # vLLM's processes may keep the pipe open after the worker: read in a thread
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RESULT ") and not result_at:
                result_at.append(time.perf_counter())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stopped = None
    while proc.poll() is None:
        now = time.perf_counter()
        if now - start > timeout:
            stopped = f"timed out after {timeout} s"
            break
        if result_at and now - result_at[0] > grace:
            stopped = f"killed {grace} s after its result: the process had not exited"
            break
        time.sleep(0.2)
    _kill_group(proc.pid)
    reader.join(timeout=30)
    return "".join(lines), stopped, proc.poll()


def error_lines(output: str, keep: int = 6) -> list[str]:
    """The last distinct lines of a process's output that name an error (exception lines, vLLM's
    ERROR log records), oldest first."""
    marks = ("Error", "Exception", "ERROR", "Timeout", "Killed")
    seen, picked = set(), []
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("RESULT ") or line in seen or not any(m in line for m in marks):
            continue
        seen.add(line)
        picked.append(line[:400])
        if len(picked) == keep:
            break
    return picked[::-1]


def _kill_group(pgid: int) -> None:
    import signal
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
