"""A `duet serve` on a free port for the Python tests: started with
--port 0 (the port is read from its log), stopped with SIGTERM."""
import os
import re
import signal
import subprocess
import tempfile
import time


class Server:
    def __init__(self, duet, model, *extra, ctx=1024, start_timeout=120):
        self.log = tempfile.NamedTemporaryFile(prefix="duet-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [duet, "serve", "-m", model, "--backend", "cpu", "--port", "0", "-c", str(ctx), *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        deadline = time.time() + start_timeout
        while time.time() < deadline and self.port is None:
            if self.proc.poll() is not None:
                raise AssertionError(f"duet serve exited during start-up:\n{self.text()}")
            m = re.search(r" on http://[^\s]*:(\d+)\n", self.text())
            if m:
                self.port = int(m.group(1))
            time.sleep(0.05)
        if self.port is None:
            raise AssertionError(f"duet serve did not start:\n{self.text()}")
        self.base = f"http://127.0.0.1:{self.port}"

    def text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=60)
        log = self.text()
        os.unlink(self.log.name)
        return rc, log
