"""A Python runner tool: the model's code in a fresh `python -I` subprocess with time and memory limits.

What is isolated: the process gets its own empty temporary folder as its working directory (deleted after),
an environment with nothing but PATH and LANG (no credentials from the trainer's environment), CPU time and
address space limits (`resource.setrlimit`: RLIMIT_CPU, RLIMIT_AS), a file size limit, no core dumps, and a
wall-clock limit after which its whole process group is killed. `-I` keeps the user's site-packages and
PYTHON* variables out.

What is NOT isolated (best effort only; use a container or gVisor for untrusted models at scale): the file
system outside the temporary folder is readable and, where the trainer's user may write, writable by absolute
path; the network is reachable (no network namespace: `unshare` needs privileges this process does not
assume); the process runs as the trainer's user. Linux/macOS only (resource module).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from shardrl.tools.base import Tool


# The limits are set by the child itself before the model's code runs (a preexec_fn is unsafe in a process
# with threads, and tools run in a thread pool).
_BOOT = """
import resource, sys
cpu, memory, files = (int(v) for v in sys.argv[1:4])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, files),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
code = sys.argv[4]
sys.argv = ["-c"]
del resource, sys, cpu, memory, files, limit, value
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000) -> str:
    """stdout (and stderr, after a marker) of `code` run in a sandboxed subprocess, cut to `max_output_chars`;
    "error: ..." when it timed out or was killed."""
    with tempfile.TemporaryDirectory(prefix="shardrl_py_") as cwd:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": cwd, "TMPDIR": cwd}
        limits = [str(max(1, int(timeout_s + 0.999))), str(memory_mb << 20), str(16 << 20)]
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, *limits, code], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own process group: a timeout kills its children too
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"error: the code ran longer than {timeout_s:g} s and was stopped"
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        text = f"error: the process was killed by {name} (time limit {timeout_s:g} s, memory limit {memory_mb} MB)"
    else:
        text = out + (f"\n[stderr]\n{err}" if err.strip() else "")
    return text if len(text) <= max_output_chars else text[:max_output_chars] + "\n[output cut]"


class PythonTool(Tool):
    name = "python"
    description = ("Runs Python 3 code in a fresh process and returns what it prints (stdout, then stderr). "
                   "No state is kept between calls; print the result you want to see.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"]}

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000):
        self.timeout_s, self.memory_mb, self.max_output_chars = timeout_s, memory_mb, max_output_chars

    def call(self, args: dict) -> str:
        return run_python(args["code"], self.timeout_s, self.memory_mb, self.max_output_chars)
