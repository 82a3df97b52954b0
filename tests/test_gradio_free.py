"""The Studio's logic apart from its page: the modules the GPU proof drives (the Studio's handlers, the soak, the
preset check, gpu_check, the visualizers) import, and a click runs and is stepped through, in a process where gradio
cannot be imported; `app/ui.py` defines no handler, and every event it wires is a Studio handler behind its adapter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from app import Settings, build_app
from app.studio import SessionState

from fixtures.fake_engine import fake_factory

ROOT = Path(__file__).parent.parent

WITHOUT_GRADIO = """
import sys


class NoGradio:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("gradio", "gradio_client"):
            raise ImportError(f"{name} is not installed here")


sys.meta_path.insert(0, NoGradio())
import app.preset_check, app.soak, app.studio, specextend.tools.gpu_check, visualizers  # noqa: E401
from app.settings import BUNDLED, Settings
from app.studio import SessionState, Studio
from fixtures.fake_engine import fake_factory

studio, state = Studio(fake_factory(), Settings()), SessionState()
*_, last = studio.run(state, " ".join(f"word{i}" for i in range(300)), "Summarize.", BUNDLED, "specextend",
                      ["autoregressive"], "0", max_new_tokens=8)
shown, run, slider, words, download = studio.stepper(state)
assert "Done." in last[0] and shown.visible and run.value == "specextend" and "Step" in words, (last[0], words)
assert "Done." in last[1] and "<" not in last[1] and download.visible, last[1]  # the status as plain text too
assert studio.step_by(-1)(state, "specextend", slider.value)[0] == slider.value - 1
gradio = sorted(m for m in sys.modules if m.split(".")[0] in ("gradio", "gradio_client"))
assert not gradio, gradio
print("ran without gradio")
"""


def test_the_proofs_modules_import_and_a_click_runs_where_gradio_cannot_be_imported():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_GRADIO], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ran without gradio" in done.stdout, done.stderr[-3000:]


def test_the_page_module_defines_no_handler_and_wires_only_studio_handlers():
    tree = ast.parse((ROOT / "app" / "ui.py").read_text(encoding="utf-8"))
    assert not [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert functions == {"gradio_value", "gradio_answer", "wired", "refuse_quietly", "build_app", "launch"}
    for name in ("studio", "stepping", "updates", "panels", "runner"):  # the gradio-free side names no gradio
        source = ast.parse((ROOT / "app" / f"{name}.py").read_text(encoding="utf-8"))
        imported = {alias.name for node in ast.walk(source) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(source) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {m for m in imported if m.split(".")[0] in ("gradio", "gradio_client")}, name
    demo = build_app(fake_factory(), Settings())
    # every function the page calls but a tab's fresh session state (gradio calls the State's class to make one)
    handlers = [block.fn for block in demo.fns.values() if block.fn not in (None, SessionState)]
    assert len(handlers) >= 20
    for fn in handlers:  # each one the adapter's, around a handler of the Studio (app.studio or app.stepping)
        inner = getattr(fn, "__wrapped__", None)
        assert inner is not None and inner.__module__ in ("app.studio", "app.stepping"), fn
