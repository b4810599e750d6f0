"""A launcher with graph_trainer already imported, for the tests' runs: `helpers.launch` asks it for a run instead of
starting `python -m graph_trainer` (or torchrun) afresh.

Each process of a run used to import torch, torchtitan and graph_trainer before doing anything: about 5 s of CPU a
process on a 2-core machine (`import graph_trainer.trainer`), where a 2-rank run of one step of a one-layer model took
9.4 s and 10 steps of the debug model 17.5 s; the suite ran 58.6 minutes, 41.6 with this launcher (same machine, same
tests). Here one process per test worker imports them once and forks each run's ranks from that state, as
`torchrun --standalone` would start them: the same CLI entry
(`cli.entry_point`) with the rank's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT), the rendezvous store hosted by the launcher as torchrun's agent hosts it
(TORCHELASTIC_USE_AGENT_STORE), the other ranks stopped when one fails, and torchrun's exit code (1 when a rank of
several failed). A run whose environment differs from the launcher's (a test's own variables, read when torch is
imported too) or that runs a script of its own is started as a fresh process by `helpers.launch`, as before.

Protocol, one connection per run on a Unix socket: the client sends one JSON line (argv, nproc, environment, cwd,
stdout and stderr file paths); the launcher forks a manager for the run, which answers with its process id (its process group:
the client kills it on a timeout) and, when every rank has ended, the exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback

PRELOAD = ("graph_trainer.cli", "graph_trainer.trainer", "graph_trainer.validate", "graph_trainer.precompile",
           "graph_trainer.plan", "graph_trainer.compare")
"""What every run imports (the trainer, the checks before it, the other commands), imported once here."""

STOP_GRACE_S = 10.0
"""How long the other ranks of a failed run get after SIGTERM before SIGKILL (torchrun's agent does the same)."""


def _rank(request: dict, rank: int, port_reader: int) -> None:
    """The body of one rank's process: its environment, its output files, then the CLI entry (which exits)."""
    try:
        nproc = request["nproc"]
        env = dict(request["env"])
        if nproc > 1:
            port = os.read(port_reader, 16).decode().strip()
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                       GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
                                (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = ["graph-trainer", *request["argv"]]
        from graph_trainer.cli import entry_point

        entry_point()
    except BaseException:  # noqa: BLE001  (the rank's process ends here, with its error on its stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _signal(pids: list[int], ended: dict[int, int], signum: int) -> None:
    for pid in pids:
        if pid not in ended:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _manage(conn: socket.socket, request: dict) -> int:
    """One run: fork its ranks, host their store, wait for them; returns the run's exit code."""
    os.setsid()
    conn.sendall(f"{os.getpid()}\n".encode())
    nproc = request["nproc"]
    reader, writer = os.pipe()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.close(writer)
            conn.close()
            _rank(request, rank, reader)
        pids.append(pid)
    os.close(reader)
    store = None
    if nproc > 1:
        # after the forks: a store's server thread must not be running when a rank's process is made; it serves the
        # ranks until they have all ended (this function's end)
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        os.write(writer, "".join(f"{store.port}\n".ljust(16) for _ in range(nproc)).encode())
    os.close(writer)
    ended: dict[int, int] = {}
    deadline = None
    while len(ended) < nproc:
        pid, status = os.wait()
        ended[pid] = os.waitstatus_to_exitcode(status)
        if ended[pid] != 0 and deadline is None:
            _signal(pids, ended, signal.SIGTERM)
            deadline = threading.Timer(STOP_GRACE_S, _signal, (pids, ended, signal.SIGKILL))
            deadline.start()
    if deadline is not None:
        deadline.cancel()
    codes = [ended[p] for p in pids]
    if nproc == 1:
        return codes[0]
    return 0 if all(c == 0 for c in codes) else 1


def serve(path: str) -> None:
    for module in PRELOAD:
        __import__(module)
    # forking a process that runs threads can leave a lock held in the child forever
    assert threading.active_count() == 1, threading.enumerate()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    managers: set[int] = set()
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
        for pid in list(managers):
            if os.waitpid(pid, os.WNOHANG)[0]:
                managers.discard(pid)
        if sys.stdin in readable and not sys.stdin.readline():
            return  # the test worker ended
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        request = json.loads(conn.makefile().readline())
        pid = os.fork()
        if pid == 0:
            listener.close()
            code = 1
            try:
                code = _manage(conn, request)
            finally:
                conn.sendall(f"{code}\n".encode())
                os._exit(0)
        managers.add(pid)
        conn.close()


if __name__ == "__main__":
    # as `python -m graph_trainer` run from the repository: its root first on the path, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    serve(sys.argv[1])
