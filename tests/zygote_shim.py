"""A ``.venv/bin/python`` for a folder laid out like the repository (docs/guide.md's work folder,
tests/test_docs.py) that runs ``python -m ddp_exp ...`` forked from this test process's
pre-imported server (:mod:`zygote`) and execs the real interpreter for everything else: the
guide's blocks still run in bash as a reader types them, without ~2.5 s of imports per run.

:func:`install` builds the folder's ``.venv``: every entry of the real one (``sys.prefix``) and
of its ``bin/`` as a symlink (console scripts such as ``torchrun`` name the real interpreter in
their ``#!`` line), except ``bin/python``, a four-line script run by the real interpreter with
``-I -S`` (no ``site``, no environment: ~15 ms) that calls :func:`main` with the server's
address and what :func:`zygote.usable` compares. Only ``os`` and ``sys`` are imported at
start (~25 ms to an exec of the real interpreter); ``signal``, ``socket``, ``struct`` and ``json``
(~40 ms more) only for a ``python -m ddp_exp`` command.

:func:`main` hands the run to the server when the command is exactly ``python -m ddp_exp ...``
and nothing read at start-up differs from the server's (``zygote.usable``: the ``PYTHON*``,
``OMP_*``, ... variables, a ``sitecustomize`` on ``PYTHONPATH``, a tag longer than the
server's placeholder), and SIGINT, SIGTERM and SIGHUP are not ignored (a shell's background
job, ``nohup``: the real interpreter keeps them ignored, a forked run would not). It passes its
own stdin/stdout/stderr (file descriptors), cwd, environment and arguments; forwards SIGINT and
SIGTERM to the run (its own process group: a terminal's Ctrl-C reaches the shim, which passes it
on, as ``kill -INT`` of a real launcher); and ends with the run's status (a run ended by a
signal: that signal, raised again). Otherwise, or when the server cannot be reached before the
run starts, it execs the real interpreter with the same arguments (the same pid).
"""

from __future__ import annotations

import os
import sys

FORWARDED = ("SIGINT", "SIGTERM")
# Ignored at start, these keep a real interpreter's run ignoring them; a forked run would not.
MUST_NOT_BE_IGNORED = ("SIGINT", "SIGTERM", "SIGHUP")


def forkable(args: list[str], env: dict[str, str], config: dict) -> bool:
    """Whether ``python *args`` with ``env`` can run forked from the server: the rules of
    :func:`zygote.usable`, with its constants and the server's start-up variables in
    ``config`` (:func:`install`)."""
    if args[:2] != ["-m", "ddp_exp"] or env.get(config["disable"]):
        return False
    if len(env.get(config["tag"], "")) >= config["room"]:
        return False

    def startup(variables) -> dict[str, str]:
        return {k: v for k, v in variables.items() if k not in config["handled"] and (
            k.startswith(tuple(config["prefixes"])) or k in config["names"])}

    if startup(env) != config["startup"]:
        return False
    for folder in env.get("PYTHONPATH", "").split(os.pathsep):
        if folder and any(os.path.exists(os.path.join(folder, name))
                          for name in ("sitecustomize.py", "usercustomize.py")):
            return False
    import signal

    return all(signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN
               for name in MUST_NOT_BE_IGNORED)


def _send_request(address: str, args: list[str]):
    """A socket connected to the server, which has been handed this process's stdio, cwd,
    environment and args, as :class:`zygote.ZygoteProcess` does."""
    import json
    import socket
    import struct

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        payload = json.dumps({"args": args[2:], "cwd": os.getcwd(),
                              "env": dict(os.environ)}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(payload))], [0, 1, 2])
        conn.sendall(payload)
    except BaseException:
        conn.close()
        raise
    return conn


def run_forked(address: str, args: list[str]) -> int | None:
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
        conn = _send_request(address, args)
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
        returncode = run_forked(config["address"], args)
        if returncode is not None:
            exit_as(returncode)
    os.execv(config["real"], [config["real"], *args])


def install(venv, address: str) -> dict:
    """Make the folder ``venv`` (a :class:`pathlib.Path` not there yet) this interpreter's
    environment with a ``bin/python`` that runs ``python -m ddp_exp`` forked from the server at
    ``address`` (see the module's doc); returns the config that ``bin/python`` hands
    :func:`main`. Called by the test process that owns the server."""
    import zygote

    prefix = os.path.realpath(sys.prefix)
    venv.mkdir()
    for entry in os.scandir(prefix):
        if entry.name != "bin":
            (venv / entry.name).symlink_to(entry.path)
    (venv / "bin").mkdir()
    for entry in os.scandir(os.path.join(prefix, "bin")):
        if entry.name != "python":
            (venv / "bin" / entry.name).symlink_to(entry.path)
    config = {"real": sys.executable, "address": address, "disable": zygote.DISABLE,
              "tag": zygote.CASE_TAG, "room": len(zygote.PLACEHOLDER),
              "prefixes": list(zygote.STARTUP_PREFIXES), "names": sorted(zygote.STARTUP_NAMES),
              "handled": sorted(zygote.HANDLED),
              "startup": zygote._startup_environment(dict(os.environ))}
    shim = venv / "bin" / "python"
    shim.write_text(f"#!{sys.executable} -IS\nimport sys\n"
                    f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                    f"import zygote_shim\nzygote_shim.main({config!r})\n")
    shim.chmod(0o755)
    return config
