"""engine.loop.lifetime: a child ends with the process that started it, under every multiprocessing start method
(forkserver children have the fork server, not the starting process, for their operating-system parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    from rackbed.engine.loop.lifetime import die_with_parent

    def child(path):
        die_with_parent(poll_s=0.2)
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)

    if __name__ == "__main__":
        ctx = mp.get_context(sys.argv[1])
        p = ctx.Process(target=child, args=(sys.argv[2],))
        p.start()
        time.sleep(60)
""")


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper counts as gone
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow),
                                    pytest.param("forkserver", marks=pytest.mark.slow)])
def test_a_child_lives_while_its_parent_does_and_dies_with_it(tmp_path, method):
    script, pidfile = tmp_path / "parent.py", tmp_path / "child.pid"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script), method, str(pidfile)], env=env)
    try:
        end = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < end:
            assert parent.poll() is None, "the parent exited early"
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert not _gone(child, 1.5), f"{method}: the child exited while its parent lived"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(child, 10), f"{method}: the child outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
