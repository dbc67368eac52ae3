"""A benchmark's child process watched for memory: killed where its RSS passes a bound (the machine is shared)."""

from __future__ import annotations

import subprocess
import threading
import time


def run_guarded(cmd: list[str], *, env: dict, max_mib: float | None, cwd=None,
                poll_s: float = 0.2) -> tuple[int, str, str, float | None]:
    """Run ``cmd``; (returncode, stdout, stderr, the RSS in MiB it was killed at, or None where it was not)."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: list[float] = []

    def guard() -> None:
        while p.poll() is None:
            try:
                rss = next(int(ln.split()[1]) / 1024 for ln in open(f"/proc/{p.pid}/status")
                           if ln.startswith("VmRSS:"))
            except (OSError, StopIteration):
                return
            if max_mib is not None and rss > max_mib:
                killed.append(rss)
                p.kill()
                return
            time.sleep(poll_s)

    t = threading.Thread(target=guard, daemon=True)
    t.start()
    stdout, stderr = p.communicate()
    t.join()
    return p.returncode, stdout, stderr, (killed[0] if killed else None)
