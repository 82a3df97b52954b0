"""The README's commands as a reader types them: every line of its shell blocks is run from the repository root with
the venv's interpreter, shortened where the full command would take minutes (fewer new tokens, a tiny stand-in
target for the 7.5K-token document, the test command on one test, the app started on a free port until it
serves); every command it names in running text uses the venv's interpreter. A new command in the README fails
`test_every_readme_command_is_checked` until it gets a check here."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV = ".venv/bin/"
LIMIT_S = 600  # a hang guard only: each command takes seconds to a minute on a busy 2-core machine


def shell_lines(text: str) -> list[str]:
    """The command lines of the text's ```bash blocks: continuations joined, comments and blank lines dropped."""
    lines: list[str] = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                lines.append(re.sub(r"\s+", " ", line))
    return lines


def steps(line: str) -> list[str]:
    """A command line's commands, in the order `&&` runs them."""
    return [part.strip() for part in line.split("&&")]


def inline_commands(text: str) -> list[str]:
    """Code spans in the text (outside shell blocks) that run python or pip: a word `python`, `pip` or `python3`
    followed by arguments."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", prose)
            if re.search(r"(^|[\s=])(\S*/)?(python3?(\.\d+)?|pip)\s", span)]


def run(command: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", **env})


def ran(done: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- how each command is checked (shortened where it must be)

def check_venv(command: str, tmp_path: Path) -> None:
    """`python3 -m venv .venv`: the same call makes a venv elsewhere (without pip, which the real one installs), and
    its Python is one the project runs on."""
    ran(run(command.replace(".venv", str(tmp_path / "venv")) + " --without-pip"), command)
    version = ran(run(f"{tmp_path}/venv/bin/python -c 'import sys; print(sys.version_info >= (3, 11))'"), command)
    assert version.stdout.strip() == "True", f"{command} made a venv older than Python 3.11"


def check_pip(command: str, tmp_path: Path) -> None:
    """`pip install ...`: what it asks for is already in the venv the tests run in (resolved offline: a dry run that
    would install nothing). The CPU index itself is not reached from here."""
    offline = re.sub(r"--index-url \S+", "", command) + " --no-index --dry-run"
    done = ran(run(offline), command)
    assert "Would install" not in done.stdout, f"{command}: the venv lacks {done.stdout.split('Would install')[-1]}"


def check_app(command: str, tmp_path: Path) -> None:
    """`.venv/bin/python app.py`: the app starts and serves its page (on a free port), then is stopped."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "GRADIO_SERVER_PORT": str(port)}
    app = subprocess.Popen(command, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        began = time.monotonic()
        while time.monotonic() - began < LIMIT_S:
            assert app.poll() is None, f"{command} stopped (exit {app.returncode}): {app.stdout.read()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    assert page.status == 200 and "gradio" in page.read().decode().lower()
                    return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"{command} did not serve http://127.0.0.1:{port}/ within {LIMIT_S} s")
    finally:
        os.killpg(app.pid, 15)
        app.wait(timeout=60)


def check_tests(command: str, tmp_path: Path) -> None:
    """`bash tests/run.sh`: the whole script (interpreter, packages, lint), its pytest on one quick test of this file."""
    done = ran(run(f"{command} tests/test_readme.py::test_shell_blocks_are_read_as_typed"), command)
    assert "1 passed" in done.stdout


def check_generate(command: str, tmp_path: Path, stand_in: list[Path]) -> None:
    """`.venv/bin/python -m specextend generate ...`: as typed, with at most 4 new tokens; the 7.5K-token document
    with a tiny stand-in pair (its target reads 7.5K tokens in a second where the bundled one takes 18 s or more)."""
    if "--help" in command:
        done = ran(run(command), command)
        assert done.stdout.startswith(f"usage: {VENV}python -m specextend generate")
        return
    shortened = command + " --max-new-tokens 4"
    if "britannica_life" in command:
        shortened += f" --target {stand_in[0]} --draft {stand_in[1]}"
    done = ran(run(shortened), command)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert 1 <= len(result["token_ids"]) <= 4 and result["config"]["lookup"]["enabled"], result
    assert "reads the prompt: block" in done.stderr and "finished (" in done.stderr  # the progress on stderr


def checker(step: str):
    """The check for one command of a line, by what it runs."""
    if re.fullmatch(r"python3(\.\d+)? -m venv \.venv", step):
        return check_venv
    if step.startswith(f"{VENV}pip install "):
        return check_pip
    if step == f"{VENV}python app.py":
        return check_app
    if step == "bash tests/run.sh":
        return check_tests
    if step.startswith(f"{VENV}python -m specextend generate "):
        return check_generate
    return None


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A tiny target and draft with the bundled tokenizer and room for the 7.5K-token sample."""
    from transformers import AutoTokenizer

    from conftest import save_tiny_pair
    from specextend.tools import bundled

    return save_tiny_pair(tmp_path_factory.mktemp("stand_in"), AutoTokenizer.from_pretrained(bundled.target_dir()),
                          max_positions=8192)


README_STEPS = list(dict.fromkeys(step for line in shell_lines(README.read_text()) for step in steps(line)))


def test_shell_blocks_are_read_as_typed():
    text = "x\n```bash\na --b \\\n   --c   # note\n\n# only a note\nd && e\n```\n`f`\n```python\ng\n```\n"
    assert shell_lines(text) == ["a --b --c", "d && e"] and steps("d && e") == ["d", "e"]
    assert inline_commands("`python -m x`, `GRADIO_SERVER_PORT=1 .venv/bin/python app.py`, `python`, `python3.12`") == [
        "python -m x", "GRADIO_SERVER_PORT=1 .venv/bin/python app.py"]


def test_every_readme_command_is_checked():
    assert README_STEPS, "no shell block in the README"
    unchecked = [step for step in README_STEPS if checker(step) is None]
    assert not unchecked, f"README commands this test does not know how to run: {unchecked}"


def test_commands_in_running_text_use_the_venv():
    bare = [c for c in inline_commands(README.read_text())
            if re.search(r"(^|[\s=])(python|pip)\s", c) and not re.search(r"(^|\s)(\S*=\S*\s)*\.venv/bin/", c)]
    assert not bare, f"commands in the README's text that would run the system Python: {bare}"


@pytest.mark.parametrize("step", README_STEPS, ids=[step[:72] for step in README_STEPS])
def test_readme_command_runs(step, tmp_path, stand_in):
    check = checker(step)
    if check is check_generate:
        check(step, tmp_path, stand_in)
    else:
        check(step, tmp_path)


def test_the_clis_usage_names_the_venvs_interpreter():
    """What the CLI prints about how to run it names the venv's interpreter, as the README does (the app's port-taken
    message: tests/test_launch.py)."""
    from specextend.tools.cli import build_parser

    assert build_parser().prog == f"{VENV}python -m specextend"
