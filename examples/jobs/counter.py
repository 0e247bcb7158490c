"""A tiny elastic job without PyTorch, for cluster tests and quick experiments.

It follows the AdaptDL replica protocol by hand: it reads the ``ADAPTDL_*``
environment, asks the supervisor for its peers, restores a counter from
``ADAPTDL_CHECKPOINT_PATH``, "trains" for ``--steps`` steps (each step takes
``--step-time`` seconds split over the replicas, like data parallelism), and
on SIGTERM saves the counter and exits with 143 so the cluster can restart it
at another size. Rank 0 uploads scheduling hints saying it has profiled its
current replica count, which lets the scheduler grow it step by step.

The result (``share/result.json``) depends only on ``--steps``, never on how
often the job was rescaled, so tests can compare it with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import urllib.request

STOP = False


def _on_term(signum: int, frame: object) -> None:
    del signum, frame
    global STOP
    STOP = True


def _request(method: str, path: str, body: object | None = None) -> object:
    url = os.environ["ADAPTDL_SUPERVISOR_URL"] + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", "Bearer " + os.environ["ADAPTDL_JOB_TOKEN"])
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=40) as response:
        return json.loads(response.read())


def _save(path: str, state: dict[str, float]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--fail-at", type=int, default=-1, help="raise at this step")
    parser.add_argument("--hints", action="store_true", help="upload scheduling hints")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)

    rank = int(os.environ["ADAPTDL_REPLICA_RANK"])
    replicas = int(os.environ["ADAPTDL_NUM_REPLICAS"])
    group = int(os.environ["ADAPTDL_NUM_RESTARTS"])
    job = os.environ["ADAPTDL_JOB_ID"]
    peers = _request("GET", f"/discover/{job}/{group}?timeout=30")
    assert isinstance(peers, list) and len(peers) == replicas, peers
    ckpt = os.path.join(os.environ["ADAPTDL_CHECKPOINT_PATH"], "counter.json")
    state = {"step": 0, "total": 0.0}
    if os.path.exists(ckpt):
        with open(ckpt) as handle:
            state = json.load(handle)
        print(f"restored step {state['step']} (group {group}, {replicas} replicas)", flush=True)
    if rank == 0 and args.hints:
        _request("PUT", f"/hints/{job}", {"maxProfiledReplicas": replicas, "initBatchSize": 32})

    while state["step"] < args.steps:
        if STOP:
            if rank == 0:
                _save(ckpt, state)
            print(f"checkpointed at step {state['step']}; exiting 143", flush=True)
            return 143
        step = int(state["step"])
        if step == args.fail_at:
            raise RuntimeError(f"counter job failed on purpose at step {step}")
        time.sleep(args.step_time / replicas)
        state["total"] += math.sin(step) ** 2
        state["step"] = step + 1
        loss = 1.0 / (1.0 + state["step"])
        print(f"step {state['step']} loss {loss:.6f} replicas {replicas}", flush=True)
        if rank == 0 and state["step"] % args.checkpoint_every == 0:
            _save(ckpt, state)
    if rank == 0:
        _save(ckpt, state)
        result = os.path.join(os.environ["ADAPTDL_SHARE_PATH"], "result.json")
        _save(result, {"steps": state["step"], "total": round(state["total"], 9)})
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
