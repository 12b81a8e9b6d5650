"""A ``.venv/bin/python`` for a folder laid out like the repository (docs/guide.md's work folder,
tests/test_docs.py) that runs a ``python`` command forked from this test process's pre-imported
server (:mod:`zygote`) where it can, and execs the real interpreter otherwise: the guide's
blocks still run in bash as a reader types them, without ~2.5 s of imports per interpreter.

:func:`install` builds the folder's ``.venv``: every entry of the real one (``sys.prefix``) as a
symlink; in ``bin/``, the console scripts whose ``#!`` line names the real interpreter
(``torchrun``, ``ddp-exp``) copied with this shim as their interpreter (so that torchrun and
the ranks it starts with its ``sys.executable`` are forked too), the rest as symlinks, and
``bin/python``, a four-line script run by the real interpreter with ``-I -S`` (no ``site``, no
environment: ~15 ms) that calls :func:`main` with the server's address and what
:func:`zygote.usable` compares. Only ``os`` and ``sys`` are imported at start (~25 ms to an
exec of the real interpreter); ``signal``, ``socket``, ``struct`` and ``json`` (~40 ms more)
only for a command it forks.

:func:`main` hands the run to the server when the command has a form the server runs
(:func:`python_command`: ``-m module``, a script, ``-``, after any ``-u``; never ``-c``, which
multiprocessing's spawn uses with descriptors of its own) and nothing read at start-up differs
from the server's (``zygote.usable``: the ``PYTHON*``, ``OMP_*``, ... variables, a
``sitecustomize`` on ``PYTHONPATH``, a tag longer than the server's placeholder), and SIGINT,
SIGTERM and SIGHUP are not ignored (a shell's background job, ``nohup``: the real interpreter
keeps them ignored, a forked run would not). It passes its own stdin/stdout/stderr (file
descriptors), cwd, environment and arguments, and itself as the run's ``sys.executable``;
forwards SIGINT and SIGTERM to the run (its own process group: a terminal's Ctrl-C reaches the
shim, which passes it on, as ``kill -INT`` of a real launcher); and ends with the run's status
(a run ended by a signal: that signal, raised again). Otherwise, or when the server cannot be
reached before the run starts, it execs the real interpreter with the same arguments (the same
pid).
"""

from __future__ import annotations

import os
import sys

FORWARDED = ("SIGINT", "SIGTERM")
# Ignored at start, these keep a real interpreter's run ignoring them; a forked run would not.
MUST_NOT_BE_IGNORED = ("SIGINT", "SIGTERM", "SIGHUP")


def python_command(args: list[str]) -> tuple[bool, str, str, list[str]] | None:
    """``python *args`` read as the interpreter reads its command line, for the forms a server
    can run: ``(unbuffered, kind, target, rest)`` where ``kind`` is ``"module"`` (``-m
    target``), ``"script"`` (a file) or ``"stdin"`` (``-``), after any ``-u`` options; None
    for every other form (``-c``, which multiprocessing's spawn uses with inherited
    descriptors, other options, no command)."""
    unbuffered, i = False, 0
    while i < len(args) and args[i] == "-u":
        unbuffered, i = True, i + 1
    if i >= len(args):
        return None
    first = args[i]
    if first == "-m":
        return (unbuffered, "module", args[i + 1], args[i + 2:]) if i + 1 < len(args) else None
    if first == "-":
        return unbuffered, "stdin", "-", args[i + 1:]
    if first.startswith("-"):
        return None
    return unbuffered, "script", first, args[i + 1:]


def startup_environment(env: dict[str, str], rules: dict) -> dict[str, str]:
    """The variables of ``env`` read at start-up that a run must share with the server: names
    with one of ``rules["prefixes"]`` or among ``rules["names"]``, less ``rules["handled"]``
    (the run takes them over) and those the server's own imports set to the same value
    (``rules["set_by_imports"]``). The rules are :mod:`zygote`'s (:data:`zygote.STARTUP`)."""
    prefixes = tuple(rules["prefixes"])
    return {k: v for k, v in env.items()
            if (k.startswith(prefixes) or k in rules["names"]) and k not in rules["handled"]
            and rules["set_by_imports"].get(k) != v}


def ignored_signals() -> list[int]:
    """The signals this process ignores (a child it starts ignores them too)."""
    import signal

    return [n for n in range(1, signal.NSIG) if n not in (signal.SIGKILL, signal.SIGSTOP)
            and signal.getsignal(n) is signal.SIG_IGN]


def forkable(args: list[str], env: dict[str, str], config: dict) -> bool:
    """Whether ``python *args`` with ``env`` can run forked from the server: a form
    :func:`python_command` reads, and the rules of :func:`zygote.usable`, with its constants
    and the server's start-up variables in ``config`` (:func:`install`)."""
    if python_command(args) is None or env.get(config["disable"]):
        return False
    if len(env.get(config["tag"], "")) >= config["room"]:
        return False

    if startup_environment(env, config) != config["startup"]:
        return False
    for folder in env.get("PYTHONPATH", "").split(os.pathsep):
        if folder and any(os.path.exists(os.path.join(folder, name))
                          for name in ("sitecustomize.py", "usercustomize.py")):
            return False
    import signal

    return all(signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN
               for name in MUST_NOT_BE_IGNORED)


def _send_request(address: str, args: list[str], executable: str):
    """A socket connected to the server, which has been handed this process's stdio, cwd,
    environment and args, as :class:`zygote.ZygoteProcess` does; the run's ``sys.executable``
    is ``executable`` (this shim: what the run starts with it comes here again)."""
    import json
    import socket
    import struct

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        payload = json.dumps({"argv": args, "cwd": os.getcwd(), "env": dict(os.environ),
                              "executable": executable,
                              "ignored": ignored_signals()}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(payload))], [0, 1, 2])
        conn.sendall(payload)
    except BaseException:
        conn.close()
        raise
    return conn


def run_forked(address: str, args: list[str], executable: str) -> int | None:
    """Run ``python *args`` forked from the server at ``address``, forwarding SIGINT and SIGTERM
    to it; its status (as :attr:`subprocess.Popen.returncode`: negative for a signal), or
    ``None`` when no run was started (no server, a closed stdio descriptor)."""
    import json
    import signal

    run = {"pid": None, "pending": []}

    def forward(sig, _frame) -> None:
        if run["pid"] is None:
            run["pending"].append(sig)
        else:
            try:
                os.kill(run["pid"], sig)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward)
                for sig in (getattr(signal, name) for name in FORWARDED)}
    try:
        conn = _send_request(address, args, executable)
    except OSError:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in run["pending"]:  # as if it had come to the real interpreter at its start
            signal.raise_signal(sig)
        return None
    with conn, conn.makefile("rb") as replies:
        line = replies.readline()
        if not line:
            print("zygote_shim: the server ended before the run started", file=sys.stderr)
            return 1
        run["pid"] = json.loads(line)["pid"]
        for sig in run["pending"]:
            forward(sig, None)
        line = replies.readline()
    if not line:
        print(f"zygote_shim: the server's waiter of run {run['pid']} ended", file=sys.stderr)
        return 1
    return json.loads(line)["returncode"]


def exit_as(returncode: int) -> None:
    """End this process as the run ended: its exit status, or killed by its signal."""
    import signal

    if returncode < 0:
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):  # those take no handler
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
        returncode = 128 - returncode  # a signal that does not end a process
    os._exit(returncode)


def main(config: dict) -> None:
    """The shim's entry (``sys.argv``: the script, then python's arguments): run forked where
    :func:`forkable`, else exec ``config["real"]``."""
    args = sys.argv[1:]
    if forkable(args, dict(os.environ), config):
        returncode = run_forked(config["address"], args, config["shim"])
        if returncode is not None:
            exit_as(returncode)
    os.execv(config["real"], [config["real"], *args])


def _console_script(path: str) -> str | None:
    """The text after the ``#!`` line of ``path`` where that line names this interpreter (a
    console script such as ``torchrun``), else None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1024)
            if not head.startswith(b"#!"):
                return None
            first, _, rest = (head + fh.read()).partition(b"\n")
    except OSError:
        return None
    words = first[2:].split()
    if not words or os.path.realpath(words[0].decode()) != os.path.realpath(sys.executable):
        return None
    return rest.decode()


def install(venv, address: str) -> dict:
    """Make the folder ``venv`` (a :class:`pathlib.Path` not there yet) this interpreter's
    environment with a ``bin/python`` that runs the commands it can forked from the server at
    ``address`` (see the module's doc); returns the config that ``bin/python`` hands
    :func:`main`. Called by the test process that owns the server."""
    import zygote

    prefix = os.path.realpath(sys.prefix)
    venv.mkdir()
    for entry in os.scandir(prefix):
        if entry.name != "bin":
            (venv / entry.name).symlink_to(entry.path)
    (venv / "bin").mkdir()
    shim = venv / "bin" / "python"
    for entry in os.scandir(os.path.join(prefix, "bin")):
        if entry.name == "python":
            continue
        script = _console_script(entry.path)
        if script is None:
            (venv / "bin" / entry.name).symlink_to(entry.path)
        else:  # torchrun, ddp-exp, ...: run by the shim, so that they and their workers fork
            (venv / "bin" / entry.name).write_text(f"#!{shim}\n{script}")
            (venv / "bin" / entry.name).chmod(0o755)
    config = {"real": sys.executable, "address": address, "disable": zygote.DISABLE,
              "tag": zygote.CASE_TAG, "room": len(zygote.PLACEHOLDER),
              "prefixes": list(zygote.STARTUP["prefixes"]),
              "names": sorted(zygote.STARTUP["names"]),
              "handled": sorted(zygote.STARTUP["handled"]),
              "set_by_imports": zygote.STARTUP["set_by_imports"],
              "startup": zygote.server_startup(), "shim": str(shim)}
    shim.write_text(f"#!{sys.executable} -IS\nimport sys\n"
                    f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                    f"import zygote_shim\nzygote_shim.main({config!r})\n")
    shim.chmod(0o755)
    return config
