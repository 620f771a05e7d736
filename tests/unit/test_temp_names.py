"""Temporaries a SIGKILLed process leaves beside its output (``hdfs_io.temp_names``), found by the next
run: only those of this host whose process is gone, never a running one's or another host's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from hdfs_io import temp_names


def test_only_this_hosts_temporaries_of_processes_that_are_gone_are_stale():
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
        host = temp_names._host()
        mine = temp_names.temp_name("pred.arrow", "tmp")
        assert mine.startswith(f".pred.arrow.tmp-{host}-{os.getpid()}-")
        names = [f".pred.arrow.tmp-{host}-{dead.pid}-0badc0de",          # killed: stale
                 f".pred.arrow.tmp-{host}-{live.pid}-12345678",          # still running
                 f".pred.arrow.tmp-other-host-{dead.pid}-0badc0de",      # another host's: unknown
                 f".other.arrow.tmp-{host}-{dead.pid}-0badc0de",         # another output's
                 f".pred.arrow.converting-{host}-{dead.pid}-0badc0de",   # another tag
                 mine, "pred.arrow", ".pred.arrow.tmp-garbage"]
        assert temp_names.stale(names, "pred.arrow", "tmp") == [names[0]]
    finally:
        live.kill()
        live.wait(10)
