"""What the pool tests share: the scheduler state of keel's worker threads (Linux)."""

from __future__ import annotations

import os


def worker_states() -> list[str]:
    """The scheduler state (R running, S sleeping...) of each keel-worker thread."""
    states = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "keel-worker":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:                  # the thread ended meanwhile
            continue
    return states
