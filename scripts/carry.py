"""The GPU proof's carry: the wheels the proof needs on the GPU image, downloaded into .whl/, and what a call takes.

    python scripts/carry.py                 # download the wheels (CPython 3.12, manylinux x86_64) and print the plan
    python scripts/carry.py --no-download   # the plan from what .whl/ holds now

A call to the GPU machine takes the working tree (tracked files, and untracked ones git does not ignore) and the
ignored paths it names in `carry`: 64 MiB in all, and this project's bar is 60 MiB. The GPU image (IMAGE below) has
CPython 3.12, torch 2.11, transformers 5.17 and Triton, and no gradio, plotly, orjson or gguf, so four wheels
travel (WHEELS below; their versions are requirements.txt's pins). `WHEELS=.whl bash scripts/gpu_proof.sh` installs
them offline there.

The list is checked against the proof's imports: the modules its parts run (`-m` in scripts/gpu_proof.sh) and its
preflight imports, followed through the project's own modules, imports inside functions included; left out are
optional ones (under a `try` that catches ImportError) and a package's module-level `__getattr__` (an import on a
name's first use). What they import from outside the project and the standard library that the image lacks, or has
older than requirements.txt pins, must travel; each carried wheel's own requirements must be on the image or travel.
Knows files, git, pip and the proof's script; imports nothing of the project.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROOF = ROOT / "scripts" / "gpu_proof.sh"
FOLDER = ".whl"  # ignored (.gitignore); the call names it in `carry`
BAR_MIB = 60.0  # a call's tree and wheels together; the machine's own limit is 64 MiB
MIB = 2**20

# what travels, and why; the version of each is requirements.txt's pin
WHEELS = {
    "transformers": "the image's 5.17 calls the cache past_key_values and ignores the engine's cache= "
                    "(5.24 and newer: specextend.models.TRANSFORMERS_MIN)",
    "plotly": "the app's panels, drawn by every click that the presets and the soak make",
    "orjson": "the Studio serialises each panel's figure with it (app.studio, app.updates)",
    "gguf": "the bundled models' compact weights are read with it (specextend.compact, inside its functions)",
}
NEVER_CARRIED = {"torch": "the image's CUDA build is the one the proof measures"}

# The GPU image's Python packages (CPython 3.12.3), as read on a machine running it on 2026-11-17; versions where known.
IMAGE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                  "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0"}
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
PROJECT = ("app", "specextend", "visualizers")  # the packages whose imports are followed
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def norm(name: str) -> str:
    """A distribution's name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(requirements: str) -> dict[str, str]:
    """{name: version} of every `name==version` line."""
    found = {}
    for line in requirements.splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if match:
            found[norm(match[1])] = match[2]
    return found


def specs(pinned: dict[str, str], names: Iterable[str] = WHEELS) -> dict[str, str]:
    """{name: version} to download: each name's pin (a carried wheel must be pinned, so the call runs what was tested)."""
    loose = [n for n in names if norm(n) not in pinned]
    if loose:
        raise ValueError(f"not pinned in requirements.txt: {', '.join(loose)}")
    return {norm(n): pinned[norm(n)] for n in names}


# --- what the proof imports -----------------------------------------------------------------------------------------

def proof_parts(script: str) -> dict[str, tuple[str, ...]]:
    """{part: modules it runs} from the proof's script: each `part NAME LIMIT "$PYTHON" -m MODULE`, and the preflight's
    own imports (the lines of its Python text that start with `import` or `from`)."""
    parts: dict[str, tuple[str, ...]] = {}
    preflight = re.search(r"PREFLIGHT=\$\(cat <<EOF\n(.*?)\nEOF", script, re.S)
    if preflight:
        modules = []
        for line in preflight[1].splitlines():
            if line.startswith("import "):
                modules += [m.strip().split(" as ")[0] for m in line[len("import "):].split(",")]
            elif line.startswith("from "):
                modules.append(line.split()[1])
        parts["preflight"] = tuple(modules)
    for name, module in re.findall(r'^\s*part (\w+) \S+ "\$PYTHON" -m ([\w.]+)', script, re.M):
        parts[name] = tuple(dict.fromkeys(parts.get(name, ()) + (module,)))
    return parts


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in IMPORT_ERRORS for k in kinds)


class _Imports(ast.NodeVisitor):
    """The absolute names a module's code imports, at any depth, but not those a `try` catching ImportError guards."""

    def __init__(self, package: str):
        self.package = package
        self.found: list[str] = []

    def visit_Try(self, node: ast.Try) -> None:
        optional = any(_catches_import_error(h) for h in node.handlers)
        for stmt in [*([] if optional else node.body), *node.handlers, *node.orelse, *node.finalbody]:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [alias.name for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        self.found += [base] + [f"{base}.{alias.name}" for alias in node.names]  # a name may be a submodule


def imports_in(source: str, module: str, package: bool) -> list[str]:
    """The absolute module names `module`'s source imports (`package`: it is a package's __init__)."""
    visitor = _Imports(module if package else module.rpartition(".")[0])
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.FunctionDef) and node.name == "__getattr__"):  # a name's import on first use
            visitor.visit(node)
    return visitor.found


def module_file(root: Path, module: str) -> Path | None:
    """The file a project module is read from (a package's __init__ before a same-named .py, as Python looks)."""
    path = root.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def outside_imports(entries: Iterable[str], root: Path = ROOT, project: Iterable[str] = PROJECT) -> dict[str, set[str]]:
    """{top-level name: the project modules that import it} for every import from outside the project and the standard
    library, reached from `entries` through the project's modules (importing a.b runs a's __init__ first)."""
    project = set(project)
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = [(module, "(entry)") for module in entries]
    while todo:
        module, importer = todo.pop()
        top = module.partition(".")[0]
        if top not in project:
            if top and top not in sys.stdlib_module_names:
                found.setdefault(top, set()).add(importer)
            continue
        if module in seen:
            continue
        seen.add(module)
        parent = module.rpartition(".")[0]
        if parent:
            todo.append((parent, importer))
        path = module_file(root, module)
        if path is not None:  # else a name taken from a module (`from .x import f`)
            todo += [(name, module) for name in imports_in(path.read_text(), module, path.name == "__init__.py")]
    return found


def distributions(tops: Iterable[str]) -> dict[str, str]:
    """{top-level import name: the distribution that provides it here} (the name itself where none is installed)."""
    provided = importlib.metadata.packages_distributions()
    return {top: norm(provided.get(top, [top])[0]) for top in tops}


def must_travel(dist: str, pinned: dict[str, str]) -> bool:
    """Whether the image cannot serve `dist`: it lacks it, or has it older than requirements.txt pins it."""
    if dist in NEVER_CARRIED:
        return False
    if dist not in IMAGE:
        return True
    known = IMAGE_VERSIONS.get(dist)
    return bool(known and dist in pinned and Version(known) < Version(pinned[dist]))


def needs(parts: dict[str, tuple[str, ...]], pinned: dict[str, str], root: Path = ROOT) -> dict[str, dict[str, set[str]]]:
    """{part: {distribution that must travel: the project modules importing it}}."""
    result = {}
    for part, modules in parts.items():
        tops = outside_imports(modules, root)
        dists = distributions(tops)
        result[part] = {}
        for top, dist in dists.items():
            if must_travel(dist, pinned):
                result[part].setdefault(dist, set()).update(tops[top])
    return result


def unmet(requires: Iterable[str], carried: Iterable[str]) -> list[str]:
    """The requirements (Requires-Dist lines) of a carried wheel that neither the image nor the carry meets on Python
    3.12 (extras left out; a version is checked where the image's is known)."""
    environment = {**default_environment(), "python_version": PYTHON, "python_full_version": PYTHON + ".3",
                   "sys_platform": "linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "extra": ""}
    carried = {norm(c) for c in carried}
    missing = []
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = norm(requirement.name)
        if name in carried:
            continue
        known = IMAGE_VERSIONS.get(name)
        if name not in IMAGE or (known and not requirement.specifier.contains(known, prereleases=True)):
            missing.append(f"{line} (image: {known or ('present' if name in IMAGE else 'absent')})")
    return missing


# --- the wheels and the tree -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalized distribution name
    version: str
    size: int  # bytes

    @property
    def requires(self) -> list[str]:
        """The wheel's Requires-Dist lines, read from its METADATA."""
        with zipfile.ZipFile(self.path) as archive:
            member = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
            text = archive.read(member).decode()
        return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def wheels_in(folder: Path) -> list[Wheel]:
    """The wheels in `folder` (name-version-...whl), sorted by name."""
    found = []
    for path in sorted(folder.glob("*.whl")):
        name, version = path.name.split("-")[:2]
        found.append(Wheel(path, norm(name), version, path.stat().st_size))
    return sorted(found, key=lambda w: w.name)


def download(wanted: dict[str, str], folder: Path) -> list[Path]:
    """Leave in `folder` exactly the wheels `wanted` ({name: version}, CPython 3.12 manylinux x86_64) names, fetching
    the missing ones with pip; returns the files removed (one version of each: two would stop the offline install)."""
    folder.mkdir(parents=True, exist_ok=True)
    removed = [w.path for w in wheels_in(folder) if wanted.get(w.name) != w.version]
    for path in removed:
        path.unlink()
    have = {w.name for w in wheels_in(folder)}
    missing = [f"{name}=={version}" for name, version in wanted.items() if name not in have]
    if missing:
        platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(folder), *missing],
                       check=True)
    return removed


def tree_bytes(root: Path = ROOT) -> tuple[int, int, int, int]:
    """(tracked files, their bytes, untracked files git does not ignore, their bytes): the working tree a call takes."""
    def listed(*args: str) -> list[Path]:
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=root, capture_output=True, check=True).stdout
        return [root / p for p in out.decode().split("\0") if p and (root / p).exists()]  # a deleted file travels not

    tracked, untracked = listed(), listed("--others", "--exclude-standard")
    return len(tracked), sum(p.lstat().st_size for p in tracked), len(untracked), sum(p.lstat().st_size for p in untracked)


@dataclass(frozen=True)
class Carry:
    """One call: the working tree and the wheels, against the bar."""

    tree: int  # bytes of the working tree that travels (tracked and untracked-not-ignored)
    wheels: tuple[Wheel, ...]
    bar_mib: float = BAR_MIB

    @property
    def total_mib(self) -> float:
        return (self.tree + sum(w.size for w in self.wheels)) / MIB

    @property
    def within(self) -> bool:
        return self.total_mib <= self.bar_mib


def report(carry: Carry, files: tuple[int, int], untracked: tuple[int, int], folder: str,
           part_needs: dict[str, dict[str, set[str]]], problems: list[str]) -> str:
    """The plan as printed: sizes, the total against the bar, what each part needs, the call's carry and command."""
    count = lambda n: f"{n} file{'' if n == 1 else 's'}"  # noqa: E731
    rows = [(f"tracked tree (git ls-files, {count(files[0])})", files[1], ""),
            (f"untracked, not ignored ({count(untracked[0])}; they travel too)", untracked[1], "")]
    rows += [(f"{w.name}=={w.version} ({folder}/)", w.size, WHEELS.get(w.name, "not in the list"))
             for w in carry.wheels]
    width = max(len(r[0]) for r in rows)
    lines = [f"The GPU proof's carry (bar: {carry.bar_mib:g} MiB a call, wheels included)", ""]
    lines += [f"  {label:<{width}}  {size / MIB:7.2f} MiB  {why}".rstrip() for label, size, why in rows]
    verdict = (f"within the bar, {carry.bar_mib - carry.total_mib:.2f} MiB to spare" if carry.within
               else f"OVER the bar by {carry.total_mib - carry.bar_mib:.2f} MiB")
    lines += [f"  {'total':<{width}}  {carry.total_mib:7.2f} MiB  {verdict}", "",
              "What each part imports that the image cannot serve:"]
    lines += [f"  {part:<10} {', '.join(sorted(dists)) or '-'}" for part, dists in part_needs.items()]
    lines += ["", *(f"PROBLEM: {p}" for p in problems)] if problems else []
    lines += ["", "The call:", f'  carry:   ["{folder}"]', f"  command: WHEELS={folder} bash scripts/gpu_proof.sh"]
    return "\n".join(lines)


def problems_of(carried: list[Wheel], wanted: dict[str, str], part_needs: dict[str, dict[str, set[str]]]) -> list[str]:
    """What stops the call: a wheel missing or extra, a needed package the list leaves out, an unmet requirement."""
    found = []
    needed = {dist: importers for need in part_needs.values() for dist, importers in need.items()}
    for dist in sorted(needed.keys() - wanted.keys()):
        found.append(f"the proof imports {dist} (from {', '.join(sorted(needed[dist]))}), which the image lacks and "
                     "WHEELS does not carry")
    found += [f"{name} is carried but nothing the proof runs imports it" for name in sorted(wanted.keys() - needed.keys())]
    have = {w.name: w for w in carried}
    found += [f"{FOLDER}/ lacks {name}=={version}" for name, version in wanted.items()
              if name not in have or have[name].version != version]
    for wheel in carried:
        found += [f"{wheel.name} needs {line}" for line in unmet(wheel.requires, have)]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-download", action="store_true", help=f"plan from what {FOLDER}/ holds; fetch nothing")
    args = p.parse_args(argv)
    pinned = pins((ROOT / "requirements.txt").read_text())
    wanted = specs(pinned)
    folder = ROOT / FOLDER
    if not args.no_download:
        for path in download(wanted, folder):
            print(f"removed {path.name} (not in the list)")
    carried = wheels_in(folder) if folder.is_dir() else []
    part_needs = needs(proof_parts(PROOF.read_text()), pinned)
    tracked_n, tracked_b, untracked_n, untracked_b = tree_bytes()
    carry = Carry(tracked_b + untracked_b, tuple(carried))
    problems = problems_of(carried, wanted, part_needs)
    print(report(carry, (tracked_n, tracked_b), (untracked_n, untracked_b), FOLDER, part_needs, problems))
    return 0 if carry.within and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
