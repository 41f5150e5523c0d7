"""Stop a launched training job together with every process under it (Linux /proc).

torchrun starts each worker in a session of its own, so killing the launcher's process group
leaves the workers running; on a GPU they keep its memory and the next job runs out of it (seen
on the device machine after run_variants.py timed a job out).
"""

from __future__ import annotations

import os
import signal


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children, found, todo = _children_by_parent(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` (a process-group leader, e.g. started with start_new_session=True), its
    group and every descendant. Everything is stopped first and collected before the kill: a
    dead parent's children are re-parented to init and can no longer be found, and a running
    launcher could start a new worker meanwhile."""
    _signal(pid, signal.SIGSTOP, group=True)
    stopped: set[int] = set()
    while True:  # stop new descendants until the tree holds still
        tree = set(descendants(pid)) - stopped
        if not tree:
            break
        for p in tree:
            _signal(p, signal.SIGSTOP)
        stopped |= tree
    _signal(pid, signal.SIGKILL, group=True)
    for p in stopped:
        _signal(p, signal.SIGKILL)
