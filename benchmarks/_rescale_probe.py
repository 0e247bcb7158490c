"""Run a training script and record when each rescale phase ends (for rescale.py).

Usage: ``python _rescale_probe.py EVENTS_FILE SCRIPT [ARGS...]``. The probe
appends JSON lines to EVENTS_FILE: its own start (the process is up), the end
of the heavy imports (torch and adaptdl.torch), the time spent in
``init_process_group`` (rendezvous) and in every
``adaptdl.checkpoint.load_state`` (restore), the end of the first optimizer
step, and on the way out the start and end of
``adaptdl.checkpoint.save_all_states`` and the interpreter's exit (its
``atexit`` hooks, or an ``os._exit`` call, which skips them). Then it runs
SCRIPT as ``__main__``. The hooks are installed before the script imports
anything, so ``from adaptdl.checkpoint import load_state`` in the library sees
them too.
"""

from __future__ import annotations

import time

T_START = time.time()

import atexit  # noqa: E402 - the start time is taken before any import
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

EVENTS = sys.argv[1]
SCRIPT = sys.argv[2]
RANK = int(os.environ.get("ADAPTDL_REPLICA_RANK", "0"))
GROUP = int(os.environ.get("ADAPTDL_NUM_RESTARTS", "0"))


def emit(event: str, when: float | None = None, **extra: Any) -> None:
    record = {"event": event, "t": time.time() if when is None else when}
    record.update(rank=RANK, group=GROUP, **extra)
    with open(EVENTS, "a") as handle:
        handle.write(json.dumps(record) + "\n")


emit("process_start", T_START)
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import adaptdl.checkpoint as checkpoint  # noqa: E402

_load_state = checkpoint.load_state


def _timed_load(state: Any) -> bool:
    started = time.time()
    try:
        return _load_state(state)
    finally:
        emit("restore", started, duration=time.time() - started, state=state.name)


checkpoint.load_state = _timed_load
_save_all = checkpoint.save_all_states


def _timed_save() -> str | None:
    emit("save_start")
    try:
        return _save_all()
    finally:
        emit("save_end")


checkpoint.save_all_states = _timed_save
_exited = [False]


def _emit_exit() -> None:
    if not _exited[0]:
        _exited[0] = True
        emit("exit")


atexit.register(_emit_exit)
_os_exit = os._exit


def _timed_os_exit(code: int) -> None:
    # The library leaves with os._exit(143) after a checkpoint (no atexit):
    # record the moment the process starts to go away either way.
    _emit_exit()
    _os_exit(code)


os._exit = _timed_os_exit  # type: ignore[assignment]
import adaptdl.torch  # noqa: E402

emit("imports_done")
_init = adaptdl.torch.init_process_group


def _timed_init(*args: Any, **kwargs: Any) -> None:
    started = time.time()
    _init(*args, **kwargs)
    emit("rendezvous", started, duration=time.time() - started)


adaptdl.torch.init_process_group = _timed_init
_first = [True]


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _first[0]:
        _first[0] = False
        emit("first_step")


register_optimizer_step_post_hook(_after_step)
sys.argv = [SCRIPT, *sys.argv[3:]]
sys.path.insert(0, os.path.dirname(os.path.abspath(SCRIPT)))
runpy.run_path(SCRIPT, run_name="__main__")
