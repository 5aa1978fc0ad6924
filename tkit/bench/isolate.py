"""Check kernels one by one in a child process that may hang, crash or lose its CUDA context.

A kernel that faults (illegal address, misaligned access) leaves the process's CUDA context
unusable, one that writes far out of bounds in Triton's interpreter takes the process down
with a segmentation fault, and one that deadlocks (an mbarrier phase that never completes)
never returns. ``tkit bench`` (each benchmark case: :mod:`tkit.bench.child`),
``tkit.testing.fuzz`` (isolated examples) and the GPU scripts that check many builds run such
work in a child, supervised here:

* child side, ``child_loop(names, check_one)``: for each name prints ``BEGIN name``, then
  ``OK name seconds [payload as JSON]`` or ``BAD name why``; after an error that poisons the
  context it prints ``CONTEXT_LOST`` and stops. ``names`` may be a list known in advance or
  :func:`stdin_requests`, which reads ``name body`` lines as they come;
* parent side, two ways to drive it, both on one reader of the child's lines (:class:`_Child`):
  ``supervise(argv_for, names, ...)`` for a batch known in advance (the GPU scripts that check
  many builds): starts ``argv_for(todo)``, reads its lines with a deadline a build, kills a
  child that stops answering (its process group) and starts a new one on what is left, until
  every name has an answer or the time budget is spent; and :class:`Worker` for requests that
  are decided one at a time (``tkit.testing.fuzz``: hypothesis picks the next example from the
  last one's outcome): one long-lived child, asked one request at a time, started again after
  it dies, hangs or loses its context.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: words in an exception's text that mean the CUDA context is gone (a device-side assert and
#: torch's AcceleratorError, which carries the sticky CUDA errors, poison it as a fault does)
CONTEXT_LOST_MARKERS = ("illegal", "CUDA_ERROR", "launch failure", "misaligned",
                        "device-side assert", "AcceleratorError")


def context_lost(e: BaseException | str) -> bool:
    """Whether an exception (or its text) leaves the process's CUDA context unusable."""
    msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return any(s in msg for s in CONTEXT_LOST_MARKERS)


def one_line(text: str, limit: int = 1000) -> str:
    """``text`` on one line, at most ``limit`` characters: the head and the tail, since an
    error's tail often carries what matters most (fuzz's reproducer follows CUDA's long
    explanation of a lost context)."""
    text = text.replace("\n", " ")
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + " ... " + text[len(text) - (limit - head - 5):]


def child_loop(names: Iterable[str], check_one: Callable[[str], Any]) -> None:
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
            print(f"BAD {name} {one_line(f'{type(e).__name__}: {e}')}", flush=True)
            if context_lost(e):
                print("CONTEXT_LOST", flush=True)
                return


def stdin_requests(bodies: dict[str, str]) -> Iterator[str]:
    """Names for :func:`child_loop` read from ``name body`` lines on stdin as a
    :class:`Worker` sends them; each body is left in ``bodies[name]``. Reads line by line (no
    read-ahead), so a child that dies takes no later request with it."""
    for line in iter(sys.stdin.readline, ""):
        name, _, body = line.rstrip("\n").partition(" ")
        bodies[name] = body
        yield name


def _pump(stream, q):
    for line in stream:
        q.put(line)
    q.put(None)


class _Child:
    """One child in its own process group, its stdout and stderr read line by line."""

    def __init__(self, argv: list[str], *, stdin: bool = False, env: dict | None = None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else None,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.tail: list[str] = []
        threading.Thread(target=_pump, args=(self.proc.stdout, self.lines), daemon=True).start()

    def next_line(self, until: float) -> str | None:
        """The next line (without its newline), None when the child has ended; raises
        TimeoutError at wall-clock time ``until``. Wakes every second: a child that ended while
        a process it started (a compile worker) still holds its output open sends no end of
        file."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, min(until, time.time() + 1.0)
                                                  - time.time()))
            except queue.Empty:
                if self.proc.poll() is not None:  # ended: its last lines, if any, then the end
                    try:
                        line = self.lines.get(timeout=1.0)
                    except queue.Empty:
                        return None
                elif time.time() < until:
                    continue
                else:
                    raise TimeoutError from None
            return None if line is None else line.rstrip("\n")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def died(self) -> str:
        """Why the child ended: its exit status (a signal by name) and its last lines."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        if code is not None and code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        else:
            how = f"exit code {code}"
        return f"child died ({how}): " + " | ".join(self.tail[-5:])[-500:]


def supervise(argv_for: Callable[[list[str]], list[str]], names: list[str], *,
              deadline: float, total: float, first_deadline: float | None = None,
              hang_hint: str = "", log: Callable[[str], None] = print,
              on_begin: Callable[[str], None] | None = None,
              on_answer: Callable[[str, tuple], None] | None = None,
              env: dict | None = None) -> dict[str, tuple]:
    """{name: ("ok", payload or None) or (why not, None)} for every name.

    argv_for(todo): the child's command line for the names still to check. deadline: seconds
    a build may take from its BEGIN line; first_deadline: before the child's first BEGIN (its
    start-up, imports and first compiles; default ``deadline``); total: the budget of the whole
    check, after which the names left are "not checked: time budget". A child that ends
    before its first BEGIN would end again: every name left is marked with its output.
    on_begin(name) is called when a child starts a name, on_answer(name, answer) as soon as a
    name has its answer (for progress reports while the rest runs). env: the children's
    environment (default: this process's)."""
    status = _Answers(on_answer)
    todo = list(names)
    t_end = time.time() + total
    first = deadline if first_deadline is None else first_deadline
    while todo and time.time() < t_end:
        child = _Child(argv_for(todo), env=env)
        current, limit, progressed = None, time.time() + first, False
        while True:
            try:
                line = child.next_line(min(limit, t_end))
            except TimeoutError:
                child.kill()
                if current is not None:
                    status[current] = (f"no answer within {deadline:.0f} s{hang_hint}", None)
                    todo.remove(current)
                break
            if line is None:  # the child ended
                why = child.died()
                if current is not None:
                    status[current] = (why, None)
                    todo.remove(current)
                elif not progressed:
                    status.update({n: (why, None) for n in todo})
                    todo.clear()
                break
            if line.startswith("BEGIN "):
                current, limit, child.tail = line.split()[1], time.time() + deadline, []
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
                child.proc.wait()
                break
            else:
                child.tail.append(line)
        if child.proc.poll() is None:
            child.proc.wait()
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


class Worker:
    """One long-lived child that answers requests one at a time.

    ``argv`` runs :func:`child_loop` over :func:`stdin_requests`. ``ask(name, body)`` sends one
    request and waits for its answer: ``("ok", payload)``, or ``(why not, None)`` where the
    child answered BAD, died (``"child died (signal SIGSEGV): ..."``) or gave no answer within
    ``deadline`` seconds of its BEGIN (then it is killed). A child that died, hung or lost its
    context is started again on the next request, so one crash costs one start-up, not the
    session. ``first_deadline`` bounds a fresh child's start-up (imports) before its BEGIN.
    """

    def __init__(self, argv: list[str], *, deadline: float, first_deadline: float | None = None,
                 hang_hint: str = "", env: dict | None = None):
        self.argv, self.env = list(argv), env
        self.deadline = deadline
        self.first_deadline = deadline if first_deadline is None else first_deadline
        self.hang_hint = hang_hint
        self.starts = 0
        self._child: _Child | None = None

    def _end(self, why: str | None = None) -> str | None:
        child, self._child = self._child, None
        if child is None:
            return why
        if why is None:  # it ended on its own
            return child.died()
        child.kill()
        return why

    def ask(self, name: str, body: str) -> tuple[str, Any]:
        if " " in name or "\n" in name or "\n" in body:
            raise ValueError("a request name has no spaces and a body is one line")
        if self._child is not None and self._child.proc.poll() is not None:
            self._end("")
        fresh = self._child is None
        if fresh:
            self._child = _Child(self.argv, stdin=True, env=self.env)
            self.starts += 1
        child = self._child
        try:
            child.proc.stdin.write(f"{name} {body}\n")
            child.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died before reading: its end of file tells why, below
        limit = time.time() + (self.first_deadline if fresh else self.deadline)
        while True:
            try:
                line = child.next_line(limit)
            except TimeoutError:
                return self._end(f"no answer within {self.deadline:.0f} s{self.hang_hint}"), None
            if line is None:
                return self._end(), None
            if line.startswith(f"BEGIN {name}"):
                limit, child.tail = time.time() + self.deadline, []
            elif line.startswith(f"OK {name} "):
                parts = line.split(" ", 3)
                return "ok", (json.loads(parts[3]) if len(parts) > 3 else None)
            elif line.startswith(f"BAD {name} "):
                why = line.split(" ", 2)[2]
                if context_lost(why):  # the child prints CONTEXT_LOST and ends
                    self._end("")
                return why, None
            else:
                child.tail.append(line)

    def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        try:
            child.proc.stdin.close()
            child.proc.wait(timeout=5)
        except Exception:
            child.kill()
