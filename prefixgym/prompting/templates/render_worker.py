"""Render chat templates in a worker process, under a time, memory and output limit.

A chat template is code from a model repository. The Jinja sandbox keeps it from
reaching the machine, but not from looping 10^10 times or doubling a string until
memory runs out, and a thread cannot stop a render once it runs. So renders run in
one worker process per linting process, which the caller waits on for at most
`RenderLimits.seconds` and kills past that; the worker itself caps its address space
(`memory_bytes`, where the OS enforces it) and the length of what it returns
(`output_chars`). A limit hit is a `RenderLimitError`; an ordinary template error
comes back as `RenderError`. The next render after a kill starts a new worker.

The worker is forked from a single-threaded process (no start-up cost: it shares
the modules already imported) and otherwise started as `python -m` this module
(a clean interpreter, 1-3 s to import transformers). Requests and answers are
length-prefixed JSON frames over two pipes. Renders are serialised by a lock. On
Windows (no fork, no select on pipes) renders run in this process, without limits.

This module knows processes and pipes; what a render is belongs to `jinja_render.py`
(`render_in_process`), which the worker calls.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO

from prefixgym.prompting.templates.jinja_render import (
    RenderError,
    RenderLimitError,
    render_in_process,
)
from prefixgym.types import JSONObject

_HEADER = struct.Struct(">I")
START_SECONDS = 120.0
"""How long a worker started as a new interpreter may take to import and say ready."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render may take."""

    seconds: float = 5.0
    """Wall time of one render (a chat template renders in milliseconds)."""
    output_chars: int = 8_000_000
    """Characters one render may produce (a conversation of 2M tokens, give or take)."""
    memory_bytes: int = 512 << 20
    """Address space the worker may add to what it had when it started (Linux)."""


# -- the parent's side ------------------------------------------------------------------


class _Worker:
    """One worker process and the two pipe ends the parent holds."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.process: subprocess.Popen[bytes] | None = None
        self.pid = 0
        if hasattr(os, "fork") and threading.active_count() == 1:
            self._fork()
        else:
            self._spawn()

    def _fork(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: nothing of the parent's may run here, so no return
            try:
                os.close(to_child_w)
                os.close(from_child_r)
                _close_other_fds(keep=(to_child_r, from_child_w))
                serve(to_child_r, from_child_w, self.limits)
            finally:
                os._exit(0)
        os.close(to_child_r)
        os.close(from_child_w)
        self.pid, self.write_fd, self.read_fd = pid, to_child_w, from_child_r
        self._wait_ready()

    def _spawn(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        limits = json.dumps(self.limits.__dict__)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefixgym.prompting.templates.render_worker", limits],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.pid = self.process.pid
        self.write_fd, self.read_fd = self.process.stdin.fileno(), self.process.stdout.fileno()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Wait for the worker's first frame, sent once its renderer is imported and
        warm: a render's time limit then covers the template alone."""
        try:
            ready = self._read(time.monotonic() + START_SECONDS)
        except (TimeoutError, EOFError, OSError) as e:
            ready = {"error": type(e).__name__}
        if ready != {"ready": True}:
            self.kill()
            raise RuntimeError(f"the chat-template render worker did not start: {ready}")

    def render(self, request: JSONObject) -> JSONObject:
        _write_frame(self.write_fd, request)
        return self._read(time.monotonic() + self.limits.seconds)

    def _read(self, deadline: float) -> JSONObject:
        header = self._read_exactly(_HEADER.size, deadline)
        return json.loads(self._read_exactly(_HEADER.unpack(header)[0], deadline))  # type: ignore[no-any-return]

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        data = b""
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.read_fd, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.process is not None:
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    stream.close()
        else:
            os.waitpid(self.pid, 0)
            os.close(self.write_fd)
            os.close(self.read_fd)


_lock = threading.Lock()
_worker: _Worker | None = None


@atexit.register
def _stop_worker() -> None:
    """The worker ends with its parent (it would see the pipe close, but a spawned one
    would outlive the interpreter's last look at its child processes)."""
    global _worker
    if _worker is not None:
        _worker.kill()
        _worker = None


def render(template: str, messages: list[JSONObject], add_generation_prompt: bool,
           tools: list[JSONObject] | None, clock: datetime, variables: JSONObject,
           limits: RenderLimits) -> str:
    """`template`'s text for `messages`, rendered in the worker within `limits`.
    Raises RenderError (the template raised) or RenderLimitError (a limit was hit)."""
    global _worker
    if os.name == "nt":  # no fork, no select on pipes: render here, without limits
        return render_in_process(template, messages, add_generation_prompt, tools, clock,
                                 variables)
    request = {"template": template, "messages": messages, "tools": tools,
               "add_generation_prompt": add_generation_prompt,
               "clock": clock.isoformat(), "variables": variables}
    with _lock:
        if _worker is not None and _worker.limits != limits:
            _worker.kill()
            _worker = None
        if _worker is None:
            _worker = _Worker(limits)
        try:
            answer = _worker.render(request)
        except (TimeoutError, EOFError, OSError) as e:
            _worker.kill()
            _worker = None
            if isinstance(e, TimeoutError):
                raise RenderLimitError(f"rendering took longer than {limits.seconds:g} s "
                                       "(a loop that does not end?)") from None
            raise RenderLimitError("the render worker died while rendering (out of "
                                   "memory?)") from None
        if "limit" in answer:  # the worker is not trusted to go on after a MemoryError
            _worker.kill()
            _worker = None
            raise RenderLimitError(str(answer["limit"]))
    if "error" in answer:
        raise RenderError(str(answer["error"]))
    return str(answer["text"])


# -- the worker's side -------------------------------------------------------------------


def serve(read_fd: int, write_fd: int, limits: RenderLimits) -> None:
    """Answer render requests until the parent closes the pipe."""
    try:  # import and warm the renderer before the limits start to count
        render_in_process("{{ messages[0].content }}", [{"role": "user", "content": "x"}],
                          False, None, datetime.now(), {})
    except RenderError:
        pass
    _cap_memory(limits.memory_bytes)
    _write_frame(write_fd, {"ready": True})
    while True:
        try:
            request = _read_frame(read_fd)
        except EOFError:
            return
        try:
            text = render_in_process(
                request["template"], request["messages"], request["add_generation_prompt"],
                request["tools"], datetime.fromisoformat(request["clock"]), request["variables"])
        except MemoryError:
            _write_frame(write_fd, {"limit": "rendering needed more than "
                                             f"{limits.memory_bytes >> 20} MiB of memory"})
            return
        except RenderError as e:
            _write_frame(write_fd, {"error": str(e)})
            continue
        if len(text) > limits.output_chars:
            _write_frame(write_fd, {"limit": f"rendering produced {len(text):,} characters, "
                                             f"more than the limit of {limits.output_chars:,}"})
            continue
        _write_frame(write_fd, {"text": text})


def _cap_memory(extra_bytes: int) -> None:
    """Cap the address space at what the worker holds now plus `extra_bytes` (Linux:
    elsewhere the time limit alone stops a runaway)."""
    try:
        import resource

        with open("/proc/self/status") as f:
            vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        limit = vm_kib * 1024 + extra_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, StopIteration, ValueError):
        pass


def _close_other_fds(keep: tuple[int, ...]) -> None:
    """A forked worker holds no copy of the parent's files, sockets or pipes (which
    would keep them open after the parent closed them)."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)


def _write_frame(fd: int, obj: object) -> None:
    data = json.dumps(obj, default=str).encode()
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_frame(fd: int) -> Any:  # a decoded JSON request
    header = _read_all(fd, _HEADER.size)
    return json.loads(_read_all(fd, _HEADER.unpack(header)[0]))


def _read_all(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _main(stdin: BinaryIO, stdout: BinaryIO) -> None:
    limits = RenderLimits(**json.loads(sys.argv[1]))
    serve(stdin.fileno(), stdout.fileno(), limits)


if __name__ == "__main__":
    # Run the module under its own name: as __main__, its RenderError would be another
    # class than the one render.py raises, and a template's error would kill the worker.
    from prefixgym.prompting.templates import render_worker

    render_worker._main(sys.stdin.buffer, sys.stdout.buffer)
