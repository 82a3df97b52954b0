"""Starting the app where it cannot listen: one message that names the problem and the fix, a nonzero exit, no
traceback, and no model loaded first."""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def entry():
    """app.py as a module (the `app` package shadows its name)."""
    spec = importlib.util.spec_from_file_location("studio_entry", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def held_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_taken_port_is_a_message_with_the_fix(held_port):
    env = {**os.environ, "GRADIO_SERVER_PORT": str(held_port), "GRADIO_SERVER_NAME": "127.0.0.1",
           "SPECEXTEND_PRELOAD": "1"}  # a preload would load the pair first: the port is checked before it
    done = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert f"port {held_port} on 127.0.0.1 is already in use" in done.stderr
    assert "GRADIO_SERVER_PORT=" in done.stderr and ".venv/bin/python app.py" in done.stderr  # as the README runs it
    assert "Traceback" not in done.stderr + done.stdout
    assert "Preloading" not in done.stderr


def test_a_port_taken_while_the_app_was_built_gets_the_same_message(held_port, monkeypatch):
    studio = entry()
    monkeypatch.setenv("GRADIO_SERVER_PORT", str(held_port))
    free = {"checks": 0}

    def first_free(host, port):  # free at the first check, held by the time the server binds
        free["checks"] += 1
        return None if free["checks"] == 1 else OSError(errno.EADDRINUSE, "Address already in use")

    def launch(demo, settings):
        raise OSError(f"Cannot find empty port in range: {settings.port}-{settings.port}.")

    monkeypatch.setattr(studio, "cannot_listen", first_free)
    monkeypatch.setattr(studio, "build_app", lambda factory, settings: None)
    monkeypatch.setattr(studio, "launch", launch)
    with pytest.raises(SystemExit) as stopped:
        studio.main()
    assert f"port {held_port} on 127.0.0.1 is already in use" in str(stopped.value.code)


def test_an_address_this_machine_does_not_have_names_the_settings():
    studio = entry()
    problem = studio.cannot_listen("203.0.113.7", 7860)  # TEST-NET-3: no interface here has it
    assert problem is not None and problem.errno == errno.EADDRNOTAVAIL
    message = studio.listen_message("203.0.113.7", 7860, problem)
    assert "cannot listen on 203.0.113.7:7860" in message and "GRADIO_SERVER_NAME" in message
    assert studio.cannot_listen("127.0.0.1", 0) is None


def test_the_numerics_setting_reaches_the_factory_and_a_bad_one_stops_start_up(monkeypatch):
    studio = entry()
    built = {}
    monkeypatch.setattr(studio, "cannot_listen", lambda host, port: None)
    monkeypatch.setattr(studio, "build_app", lambda factory, settings: built.setdefault("factory", factory))
    monkeypatch.setattr(studio, "launch", lambda demo, settings: None)
    monkeypatch.setenv("SPECEXTEND_NUMERICS", "bf16")
    studio.main()
    assert built["factory"].keywords["numerics"] == "bf16"  # each loaded pair resolves it (backend.serve)
    monkeypatch.setenv("SPECEXTEND_NUMERICS", "fp16")
    with pytest.raises(SystemExit) as stopped:
        studio.main()
    assert str(stopped.value.code) == ("SpecExtend Studio cannot start: SPECEXTEND_NUMERICS must be one of auto, fp32, "
                                       "bf16, bf16-kv, got 'fp16'")
