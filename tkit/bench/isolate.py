"""Check kernels one by one in a child process that may hang or lose its CUDA context.

A kernel that faults (illegal address, misaligned access) leaves the process's CUDA context
unusable, and one that deadlocks (an mbarrier phase that never completes) never returns.
``tkit bench`` (each benchmark case: :mod:`tkit.bench.child`) and the GPU scripts that check
many builds (``scripts/gpu_cuda_ext_sweep.py``, ``scripts/gpu_cute_sm80.py``) therefore run
the work in a child and supervise it here:

* child side, ``child_loop(names, check_one)``: for each name prints ``BEGIN name``, then
  ``OK name seconds [payload as JSON]`` or ``BAD name why``; after an error that poisons the
  context it prints ``CONTEXT_LOST`` and stops;
* parent side, ``supervise(argv_for, names, ...)``: starts ``argv_for(todo)``, reads its lines
  with a deadline a build, kills a child that stops answering (its process group) and starts a
  new one on what is left, until every name has an answer or the time budget is spent.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

#: words in an exception's text that mean the CUDA context is gone (a device-side assert and
#: torch's AcceleratorError, which carries the sticky CUDA errors, poison it as a fault does)
CONTEXT_LOST_MARKERS = ("illegal", "CUDA_ERROR", "launch failure", "misaligned",
                        "device-side assert", "AcceleratorError")


def context_lost(e: BaseException) -> bool:
    """Whether an exception leaves the process's CUDA context unusable."""
    msg = f"{type(e).__name__}: {e}"
    return any(s in msg for s in CONTEXT_LOST_MARKERS)


def child_loop(names: list[str], check_one: Callable[[str], Any]) -> None:
    """Run ``check_one(name)`` for each name, reporting on stdout in the protocol above; a
    non-None return value is the OK line's payload."""
    for name in names:
        print(f"BEGIN {name}", flush=True)
        t0 = time.time()
        try:
            payload = check_one(name)
            tail = "" if payload is None else " " + json.dumps(payload, default=str)
            print(f"OK {name} {time.time() - t0:.1f}{tail}", flush=True)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
            print(f"BAD {name} {msg}", flush=True)
            if context_lost(e):
                print("CONTEXT_LOST", flush=True)
                return


def _pump(stream, q):
    for line in stream:
        q.put(line)
    q.put(None)


def supervise(argv_for: Callable[[list[str]], list[str]], names: list[str], *,
              deadline: float, total: float, first_deadline: float | None = None,
              hang_hint: str = "", log: Callable[[str], None] = print,
              on_begin: Callable[[str], None] | None = None,
              on_answer: Callable[[str, tuple], None] | None = None) -> dict[str, tuple]:
    """{name: ("ok", payload or None) or (why not, None)} for every name.

    argv_for(todo): the child's command line for the names still to check. deadline: seconds
    a build may take from its BEGIN line; first_deadline: before the child's first BEGIN (its
    start-up, imports and first compiles; default ``deadline``); total: the budget of the whole
    check, after which the names left are "not checked: time budget". A child that ends
    before its first BEGIN would end again: every name left is marked with its output.
    on_begin(name) is called when a child starts a name, on_answer(name, answer) as soon as a
    name has its answer (for progress reports while the rest runs)."""
    status = _Answers(on_answer)
    todo = list(names)
    t_end = time.time() + total
    first = deadline if first_deadline is None else first_deadline
    while todo and time.time() < t_end:
        proc = subprocess.Popen(argv_for(todo), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        current, limit, tail, progressed = None, time.time() + first, [], False
        while True:
            try:
                # wake up every second: a child that ended while a process it started (a
                # compile worker) still holds its output open sends no end of file
                wait = min(limit, t_end, time.time() + 1.0) - time.time()
                line = lines.get(timeout=max(0.1, wait))
            except queue.Empty:
                if proc.poll() is not None:  # ended: its last lines, if any, then the end
                    try:
                        line = lines.get(timeout=1.0)
                    except queue.Empty:
                        line = None
                elif time.time() < min(limit, t_end):
                    continue
                else:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    if current is not None:
                        status[current] = (f"no answer within {deadline:.0f} s{hang_hint}",
                                           None)
                        todo.remove(current)
                    break
            if line is None:  # the child ended
                why = "child died: " + " | ".join(tail[-5:])[-500:]
                if current is not None:
                    status[current] = (why, None)
                    todo.remove(current)
                elif not progressed:
                    status.update({n: (why, None) for n in todo})
                    todo.clear()
                break
            line = line.rstrip("\n")
            if line.startswith("BEGIN "):
                current, limit, tail = line.split()[1], time.time() + deadline, []
                progressed = True
                if on_begin is not None:
                    on_begin(current)
            elif line.startswith("OK "):
                parts = line.split(" ", 3)
                name, secs = parts[1], parts[2]
                status[name] = ("ok", json.loads(parts[3]) if len(parts) > 3 else None)
                log(f"check {name:32s} ok ({secs} s)")
                if name in todo:
                    todo.remove(name)
                current = None
            elif line.startswith("BAD "):
                _, name, why = line.split(" ", 2)
                status[name] = (why, None)
                log(f"check {name:32s} FAILED {why[:300]}")
                if name in todo:
                    todo.remove(name)
                current = None
            elif line == "CONTEXT_LOST":
                proc.wait()
                break
            else:
                tail.append(line)
        if proc.poll() is None:
            proc.wait()
    for name in todo:
        if name not in status:
            status[name] = ("not checked: time budget", None)
    return dict(status)


class _Answers(dict):
    """The answers so far, telling ``on_answer`` of each new one."""

    def __init__(self, on_answer):
        super().__init__()
        self._on_answer = on_answer

    def __setitem__(self, name, answer):
        super().__setitem__(name, answer)
        if self._on_answer is not None:
            self._on_answer(name, answer)

    def update(self, other):
        for name, answer in dict(other).items():
            self[name] = answer
