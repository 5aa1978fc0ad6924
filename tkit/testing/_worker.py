"""The child process of ``fuzz(isolate=True)``: ``python -m tkit.testing._worker``.

It answers one example at a time in the protocol of :mod:`tkit.bench.isolate` (requests on
stdin, ``BEGIN`` / ``OK payload`` / ``BAD`` on stdout); the payload says ``pass``, ``fail``
(with the exception, pickled where it can be) or ``crash``.

In Triton's interpreter (TKIT_FUZZ_FORK=1, set by the parent when no GPU is in use) each
example runs in a fork of this process: an out-of-bounds access there is a segmentation fault
or silent heap corruption, and a fork costs milliseconds where a fresh Python with torch and
triton costs seconds, so a crash (and every crashing candidate hypothesis tries while it
shrinks) is answered without a restart, and no example sees memory an earlier one corrupted.
On a GPU the examples run here directly (CUDA cannot be used across a fork); a fault there
is an exception that ends this process (CONTEXT_LOST), and the parent starts a new one.
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import sys
import traceback

from tkit.bench.isolate import child_loop, context_lost, stdin_requests


def _failure(e: BaseException) -> dict:
    out = {"outcome": "fail", "type": type(e).__name__, "message": str(e),
           "traceback": "".join(traceback.format_exception(e))[-4000:]}
    try:
        blob = pickle.dumps(e)
        pickle.loads(blob)  # an exception whose constructor takes other arguments fails here
        out["exception"] = base64.b64encode(blob).decode()
    except Exception:
        pass
    return out


def _decode(body: str):
    """The request, or an answer saying why it cannot be read (the functions it names could
    not be imported here). Decoding imports the user's modules: done in this process, before
    any fork, so that each example does not import them again."""
    try:
        return pickle.loads(base64.b64decode(body)), None
    except Exception as e:
        return None, {"outcome": "setup", "type": type(e).__name__, "message": str(e),
                      "traceback": traceback.format_exc()[-4000:]}


def _run(request: dict) -> dict:
    from tkit.testing.fuzz import run_example

    try:
        run_example(**request["example"])
    except Exception as e:
        if context_lost(f"{type(e).__name__}: {e}"):
            raise  # child_loop reports it and ends this process: the context is unusable
        return _failure(e)
    return {"outcome": "pass"}


def _in_fork(request: dict) -> dict:
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the example's own process
        os.close(r)
        try:
            result = _run(request)
        except BaseException as e:
            result = _failure(e)
        with os.fdopen(w, "wb") as f:
            f.write(pickle.dumps(result))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()  # read before waiting: a large answer would fill the pipe
    _, status = os.waitpid(pid, 0)
    if data:
        try:
            return pickle.loads(data)
        except Exception:
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return {"outcome": "crash", "why": f"the process running it died of signal {name}"}
    return {"outcome": "crash",
            "why": f"the process running it exited with code {os.WEXITSTATUS(status)}"}


def _warm_up() -> None:
    """Launch a tiny kernel here, before any fork: the interpreter's first launch imports and
    sets up what later launches reuse (0.3-0.5 s on these CPUs), which a fork would otherwise
    pay again for every example."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x, y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n) + 1.0, mask=offs < n)

    x = torch.arange(5, dtype=torch.float32)
    y = torch.empty_like(x)
    _copy[(1,)](x, y, 5, BLOCK=8)
    assert torch.equal(y, x + 1)
    (torch.randn(3, generator=torch.Generator().manual_seed(0)).double() - x[:3]).abs().max()


def main() -> None:
    bodies: dict[str, str] = {}
    fork = os.environ.get("TKIT_FUZZ_FORK") == "1" and hasattr(os, "fork")
    if fork:
        _warm_up()

    def check_one(name: str) -> dict:
        request, refused = _decode(bodies.pop(name))
        if refused is not None:
            return refused
        if request.get("kind") == "load":
            return {"outcome": "pass"}
        return _in_fork(request) if fork else _run(request)

    child_loop(stdin_requests(bodies), check_one)


if __name__ == "__main__":
    main()
