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
        host, boot, ns = temp_names._host(), temp_names._boot(), temp_names._pidns()
        here = f"{host}-{boot}-{ns}"
        mine = temp_names.temp_name("pred.arrow", "tmp")
        assert mine.startswith(f".pred.arrow.tmp-{here}-{os.getpid()}-") and boot != "0" and ns != "0"
        names = [f".pred.arrow.tmp-{here}-{dead.pid}-0badc0de",          # killed: stale
                 f".pred.arrow.tmp-{here}-{live.pid}-12345678",          # still running
                 f".pred.arrow.tmp-other-host-{boot}-{ns}-{dead.pid}-0badc0de",   # another host's: unknown
                 f".pred.arrow.tmp-{host}-{boot}-1-{dead.pid}-0badc0de",  # another PID namespace (container)
                 f".pred.arrow.tmp-{host}-00000000-{ns}-{dead.pid}-0badc0de",     # an earlier boot's
                 f".other.arrow.tmp-{here}-{dead.pid}-0badc0de",         # another output's
                 f".pred.arrow.converting-{here}-{dead.pid}-0badc0de",   # another tag
                 mine, "pred.arrow", ".pred.arrow.tmp-garbage"]
        assert temp_names.stale(names, "pred.arrow", "tmp") == [names[0]]
    finally:
        live.kill()
        live.wait(10)
