"""A pre-imported ``python -m ddp_exp`` forked per CLI run: the suite's CLI tests without the
seconds of start-up each (``import torch``, hydra, scikit-learn, ``torch._dynamo``: ~2.5 s of a
2.7-s digits run, 0.1 s of it training).

One server per test process (each xdist worker), started at its first CLI run, imports what a CLI
run imports and then waits on a Unix socket; it runs no torch compute and starts no thread, so
forking it is as safe as the launcher's own fork of its ranks (docs/DESIGN's fork caveat). A run is
forked twice: a waiter, which reports the run's pid and then its exit status, and the run itself,
which takes the caller's argv, cwd, environment and stdin/stdout/stderr (passed as file descriptors,
made into new ``sys`` streams as the interpreter makes them), its own process group, a fresh
``random`` seed and Python's start-up state (the fault handler where ``PYTHONFAULTHANDLER`` asks for
it, ``sys.path`` from its cwd or script and ``PYTHONPATH``), and runs the command as the interpreter
would: ``-m module``, a script, or ``-`` (the program on stdin), after any ``-u``.
``/proc/<pid>/environ`` of the run and the ranks it forks names the caller's ``DDP_EXP_CASE_TAG``
(written over the server's placeholder), so :func:`helpers.tagged_processes` finds them as it finds
a real run's.

:func:`popen` returns a :class:`ZygoteProcess` (the part of :class:`subprocess.Popen` the helpers
use: ``pid``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill``), or
``None`` where a real process is needed: ``DDP_EXP_TEST_NO_ZYGOTE=1`` (for debugging), a command
other than ``python -m ddp_exp`` or ``python -m torch.distributed.run`` (torchrun: its
``sys.executable`` is then a shim of this server, tests/zygote_shim.py, so that the ranks it
starts are forked too), an environment that changes what the interpreter does at
start-up (``PYTHON*`` other than ``PYTHONPATH``/``PYTHONFAULTHANDLER``, ``OMP_*`` other than
``OMP_NUM_THREADS`` (ddp_exp applies that one itself), ``MKL_*``,
``ATEN_CPU_CAPABILITY``, ...: read once, by the server's imports), a ``sitecustomize`` on
``PYTHONPATH``, or a server that did not start. Tests about start-up itself, signals sent to a
process group, Ctrl-C, ``kill -9``, ``make`` or packaging start real processes (they do not go
through :func:`helpers.run_tagged`). tests/zygote_shim.py is a ``.venv/bin/python`` that hands
this server the ``python -m ddp_exp`` commands of docs/guide.md's blocks, which
tests/test_docs.py runs in bash (:func:`address`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zygote_shim import ignored_signals, python_command, startup_environment

CASE_TAG = "DDP_EXP_CASE_TAG"
PLACEHOLDER = "z" * 64  # the server's tag, overwritten in each run with the caller's
DISABLE = "DDP_EXP_TEST_NO_ZYGOTE"
# Read by the interpreter or a native library once, at start-up or import: a run whose
# environment sets one of them differently from the server's starts a real process.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_", "MALLOC_")
STARTUP_NAMES = {"ATEN_CPU_CAPABILITY", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES"}
# Taken over by the run itself: PYTHONPATH and PYTHONFAULTHANDLER (below), and OMP_NUM_THREADS,
# which ddp_exp reads at run time and applies with torch.set_num_threads in the launcher and in
# every rank (rank/worker.py), overriding what the OpenMP runtime read at the server's start.
HANDLED = {"PYTHONPATH", "PYTHONFAULTHANDLER", "OMP_NUM_THREADS"}
# Set by an import in every process that makes it, the server's and a real run's alike:
# scikit-learn's (os.environ.setdefault, for Intel's OpenMP, which torch's CPU wheel does not
# load). A test process that imported scikit-learn has them; the server has them too.
SET_BY_IMPORTS = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}
# What zygote_shim.startup_environment compares, here and in the shim's config.
STARTUP = {"prefixes": STARTUP_PREFIXES, "names": STARTUP_NAMES, "handled": HANDLED,
           "set_by_imports": SET_BY_IMPORTS}
# This process's environment when the suite imported this module: the server's.
BASE_ENVIRON = dict(os.environ)
# Signals whose disposition a child inherits (ignored or not) and a run takes from its caller.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2, signal.SIGALRM)
# ``python -m`` commands run forked: ddp_exp, and torchrun (its ranks too, through the shim).
FORKED_MODULES = ("ddp_exp", "torch.distributed.run")
# What a digits run imports beyond ddp_exp's own modules (its launcher and ranks), found with
# ``python -X importtime -m ddp_exp``.
THIRD_PARTY = ("torch", "torch._dynamo", "torch.utils.tensorboard", "torch.distributed.run",
               "torch.distributed.launcher.api", "torch.distributed.elastic.rendezvous.api",
               "sklearn.datasets", "numpy.random", "tensorboard.plugins.hparams.metadata",
               "multiprocessing.popen_fork", "multiprocessing.queues", "hydra", "omegaconf",
               "filelock", "tabulate", "encodings.idna", "resource")


# ------------------------------------------------------------------------------- the server
def _import_everything() -> bytes:
    """Import what a CLI run imports; returns what the imports wrote to stderr (a run replays
    it, as its own imports would have printed it)."""
    import importlib
    import pkgutil

    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            import ddp_exp

            names = list(THIRD_PARTY) + ["ddp_exp.cli.main"] + sorted(
                m.name for m in pkgutil.walk_packages(ddp_exp.__path__, "ddp_exp.")
                if m.name != "ddp_exp.__main__")
            for name in names:
                with contextlib.suppress(Exception):
                    importlib.import_module(name)
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read()


def _environ_slot() -> tuple[int, int]:
    """Address and length of this process's placeholder tag in its initial environment (the
    memory ``/proc/<pid>/environ`` shows)."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    env_start = int(fields[47])  # field 50 of proc(5), counted from the state (field 3)
    with open("/proc/self/environ", "rb") as fh:
        initial = fh.read()
    needle = f"{CASE_TAG}={PLACEHOLDER}".encode()
    offset = initial.index(needle) + len(CASE_TAG) + 1
    return env_start + offset, len(PLACEHOLDER)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the client went away")
        data += chunk
    return data


def _become_the_run(request: dict, fds: list[int], replay: bytes, slot: tuple[int, int],
                    base_path: list[str], tagged_fd: int) -> None:
    """In the forked run: carry the caller's tag in ``/proc/<pid>/environ`` and say so by
    closing ``tagged_fd`` (the waiter reports the pid only then: a test that looks for its
    tagged processes right after the start found none), take the caller's stdio, cwd,
    environment and argv, then run ``ddp_exp`` as ``python -m ddp_exp`` would; never returns."""
    import ctypes
    import random
    import runpy

    code = 1
    try:
        tag = request["env"].get(CASE_TAG, "").encode() + b"\0"
        address, room = slot
        ctypes.memmove(address, tag.ljust(room, b"\0")[:room], room)
        os.close(tagged_fd)
        os.setpgid(0, 0)  # its own process group: nothing it signals reaches the server
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _caller_signals(request.get("ignored", []))
        unbuffered, kind, target, rest = python_command(request["argv"])
        if request.get("executable"):
            sys.executable = request["executable"]
        _fresh_stdio(unbuffered)
        python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        first = {"module": request["cwd"], "stdin": "",
                 "script": os.path.dirname(os.path.realpath(target))}[kind]
        sys.path[:] = [first, *python_path, *base_path]
        sys.path_importer_cache.clear()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if request["env"].get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable(all_threads=True)
        if replay and (kind, target) == ("module", "ddp_exp"):
            os.write(2, replay)  # what its imports printed (others import other things)
        if kind == "module":
            sys.argv = ["-m", *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "script":
            sys.argv = [target, *rest]
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = ["-", *rest]
            _run_stdin()
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001  (as the interpreter: print it, exit 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    os._exit(code)


def _caller_signals(ignored: list[int]) -> None:
    """The dispositions a real interpreter started by the caller would have: the signals the
    caller ignores ignored (they stay so across an exec), the others at their defaults
    (SIGINT: ``KeyboardInterrupt``), whatever the server inherited when it started."""
    for sig in SIGNALS:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig in ignored else default)


def _fresh_stdio(unbuffered: bool) -> None:
    """``sys.stdin``/``stdout``/``stderr`` made anew on descriptors 0-2, as the interpreter
    makes them at start (stdout line-buffered on a terminal, else block-buffered; stderr
    line-buffered, ``backslashreplace``; ``-u``: written through), not the server's."""
    import io

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    encoding = "utf-8" if sys.flags.utf8_mode else None

    def writer(fd: int, errors: str, line: bool):
        if unbuffered:
            raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
            return io.TextIOWrapper(raw, encoding=encoding, errors=errors, line_buffering=line,
                                    write_through=True)
        return open(fd, "w", buffering=1 if line else -1, encoding=encoding,  # noqa: SIM115
                    errors=errors, closefd=False)

    sys.stdin = sys.__stdin__ = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = writer(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


def _run_stdin() -> None:
    """``python -``: the program read from stdin, run as ``__main__``."""
    import builtins
    import types

    source = sys.stdin.read()
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(source, "<stdin>", "exec"), main.__dict__)  # noqa: S102


def _finish() -> None:
    """What the interpreter does at a normal exit: join threads, run atexit, flush stdio."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


def _wait_for_the_run(conn: socket.socket, request: dict, fds: list[int], replay: bytes,
                      slot: tuple[int, int], base_path: list[str]) -> None:
    """In the waiter: fork the run, report its pid, reap it, report its exit status (as
    :attr:`subprocess.Popen.returncode`: negative for a signal)."""
    tagged_r, tagged_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.close(tagged_r)
        _become_the_run(request, fds, replay, slot, base_path, tagged_w)
    os.close(tagged_w)
    for fd in fds:
        os.close(fd)
    os.read(tagged_r, 1)  # b"" once the run has closed its end: tagged (or dead)
    os.close(tagged_r)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def serve(path: str) -> None:
    """Import, listen on ``path``, say ``ready`` on stdout, then fork a run per request until
    the process that started it is gone."""
    parent = os.getppid()
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in python_path]
    replay = _import_everything()
    slot = _environ_slot()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    os.write(1, b"ready\n")
    while os.getppid() == parent:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(60)
        try:
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            head += _recv_exact(conn, 4 - len(head))
            request = json.loads(_recv_exact(conn, struct.unpack("!I", head)[0]))
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            try:
                _wait_for_the_run(conn, request, fds, replay, slot, base_path)
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


# ------------------------------------------------------------------------------- the client
class _Server:
    """This test process's server: started at the first run, ended at exit."""

    proc: subprocess.Popen | None = None
    path: str | None = None
    shim: str | None = None  # a .venv/bin/python of tests/zygote_shim.py for this server
    failed = False
    lock = threading.Lock()

    @classmethod
    def address(cls) -> str | None:
        with cls.lock:
            if cls.path is None and not cls.failed:
                cls._start()
            return cls.path

    @classmethod
    def _start(cls) -> None:
        folder = tempfile.mkdtemp(prefix="ddp-zygote-", dir="/tmp")
        path = os.path.join(folder, "s")
        # The environment the test process started with, not a test's changes of the moment
        # (the first run of a worker starts the server; its imports read them once for all).
        env = {k: v for k, v in BASE_ENVIRON.items() if k not in ("RANK", "LOCAL_RANK",
                                                                 "WORLD_SIZE")}
        env.pop("PYTHONFAULTHANDLER", None)
        env[CASE_TAG] = PLACEHOLDER
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                start_new_session=True)
        ready = threading.Event()

        def await_ready() -> None:
            if proc.stdout.readline() == b"ready\n":
                ready.set()

        threading.Thread(target=await_ready, daemon=True).start()
        if not ready.wait(600):
            proc.kill()
            proc.wait()
            cls.failed = True
            print("zygote: no server after 600 s: CLI tests start real processes",
                  file=sys.stderr)
            return
        import zygote_shim

        cls.proc, cls.path = proc, path
        cls.shim = zygote_shim.install(Path(folder) / "venv", path)["shim"]
        atexit.register(cls._stop, folder)

    @classmethod
    def _stop(cls, folder: str) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.kill()
            cls.proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _startup_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` read at start-up that a run must share with the server
    (:func:`zygote_shim.startup_environment` with :data:`STARTUP`)."""
    return startup_environment(env, STARTUP)


def server_startup() -> dict[str, str]:
    """The start-up variables (``PYTHON*``, ``OMP_*``, ...) the server imports under: those
    this process started with (:data:`BASE_ENVIRON`), whatever a test has changed since."""
    return _startup_environment(BASE_ENVIRON)


def usable(cmd: list[str], env: dict[str, str]) -> bool:
    """Whether ``cmd`` with ``env`` can run forked from the server (see the module's doc)."""
    if os.environ.get(DISABLE) or list(map(str, cmd[:2])) != [sys.executable, "-m"] \
            or len(cmd) < 3 or str(cmd[2]) not in FORKED_MODULES:
        return False
    if len(env.get(CASE_TAG, "")) >= len(PLACEHOLDER):
        return False
    if _startup_environment(env) != server_startup():
        return False
    for folder in env.get("PYTHONPATH", "").split(os.pathsep):
        if folder and any(os.path.exists(os.path.join(folder, name))
                          for name in ("sitecustomize.py", "usercustomize.py")):
            return False
    return True


class ZygoteProcess:
    """A run forked from the server, read as a :class:`subprocess.Popen` with ``text=True``,
    stdin closed and stdout/stderr piped."""

    def __init__(self, cmd: list[str], cwd, env: dict[str, str], address: str) -> None:
        self.args = cmd
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(address)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        # torchrun's ranks start with its sys.executable: the server's shim forks them too
        executable = _Server.shim if str(cmd[2]) == "torch.distributed.run" else None
        payload = json.dumps({"argv": [str(a) for a in cmd[1:]], "cwd": os.fspath(cwd),
                              "env": env, "executable": executable,
                              "ignored": ignored_signals()}).encode()
        try:
            socket.send_fds(self._conn, [struct.pack("!I", len(payload))], [null, out_w, err_w])
            self._conn.sendall(payload)
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        self._chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        self.first_output: float | None = None  # time.monotonic() of its first byte, any fd
        self._readers = [threading.Thread(target=self._read, args=(fd,), daemon=True)
                         for fd in (out_r, err_r)]
        for reader in self._readers:
            reader.start()
        self._status = self._conn.makefile("rb")
        self.pid = json.loads(self._status.readline())["pid"]
        self._out, self._err = out_r, err_r
        self._waiter = threading.Thread(target=self._await_exit, daemon=True)
        self._waiter.start()

    def _read(self, fd: int) -> None:
        with open(fd, "rb", closefd=True) as pipe:
            for chunk in iter(lambda: pipe.read1(65536), b""):
                if self.first_output is None:
                    self.first_output = time.monotonic()
                self._chunks[fd].append(chunk)

    def _await_exit(self) -> None:
        line = self._status.readline()
        self.returncode = json.loads(line)["returncode"] if line else -9
        self._conn.close()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._waiter.join(timeout)
        if self._waiter.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in [*self._readers, self._waiter]:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self._text(self._out), self._text(self._err)

    def _text(self, fd: int) -> str:
        """As ``subprocess`` decodes a pipe with ``text=True`` (universal newlines)."""
        data = b"".join(self._chunks[fd]).decode(subprocess._text_encoding())
        return data.replace("\r\n", "\n").replace("\r", "\n")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def address() -> str | None:
    """The socket of this process's server (started at the first call), or ``None`` where
    runs start real processes (``DDP_EXP_TEST_NO_ZYGOTE=1``, a server that did not start)."""
    return None if os.environ.get(DISABLE) else _Server.address()


def popen(cmd: list[str], cwd, env: dict[str, str]) -> ZygoteProcess | None:
    """``cmd`` (``python -m ddp_exp ...``) forked from this process's server, or ``None`` where
    it must start as a real process (see the module's doc)."""
    if not usable(cmd, env):
        return None
    address = _Server.address()
    if address is None:
        return None
    try:
        return ZygoteProcess(cmd, cwd, env, address)
    except (OSError, ValueError, KeyError) as exc:  # the server is gone: real processes
        print(f"zygote: {exc!r}: CLI tests start real processes", file=sys.stderr)
        _Server.failed, _Server.path = True, None
        return None


if __name__ == "__main__":
    serve(sys.argv[1])
