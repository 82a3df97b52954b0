"""Entry point: `python app.py` serves SpecExtend Studio (Hugging Face Spaces runs the same file).

On the default path the app works offline and sends no analytics: HF_HUB_OFFLINE=1 unless the operator
sets SPECEXTEND_HUB=1, and GRADIO_ANALYTICS_ENABLED=False. Both are set before gradio or transformers
are imported. It binds 127.0.0.1 unless GRADIO_SERVER_NAME says otherwise, on GRADIO_SERVER_PORT (7860);
where it cannot listen there, it says so and how to pick another port, before any model loads. See
app/settings.py for every variable.
"""

import errno
import logging
import os
import socket
from functools import partial

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
if os.environ.get("SPECEXTEND_HUB", "0").strip() != "1":
    os.environ["HF_HUB_OFFLINE"] = "1"

from app import Settings, build_app, launch, real_factory  # noqa: E402  (after the environment is set)


def cannot_listen(host: str, port: int) -> OSError | None:
    """Why the app cannot listen on host:port (None where it can), found by binding it as the server will."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed server's port is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc
    return None


def listen_message(host: str, port: int, problem: OSError) -> str:
    """What to tell the operator whose address or port cannot be served, with the fix."""
    if problem.errno != errno.EADDRINUSE:
        return (f"SpecExtend Studio cannot listen on {host}:{port}: {problem.strerror or problem}. Set "
                "GRADIO_SERVER_NAME and GRADIO_SERVER_PORT to an address and port this machine can serve on.")
    free = next((p for p in range(port + 1, min(port + 50, 65536)) if cannot_listen(host, p) is None), None)
    fix = f"GRADIO_SERVER_PORT={free if free is not None else '<a free port>'} .venv/bin/python app.py"
    return (f"SpecExtend Studio cannot start: port {port} on {host} is already in use (is the Studio already "
            f"running? Then open http://{host}:{port}/). Stop the program that holds the port, or serve on "
            f"another one:\n    {fix}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("app").setLevel(logging.INFO)  # the app's own progress (a preload), not every HTTP request
    logging.getLogger("specextend.tools.bundled").setLevel(logging.INFO)  # the bundled target's first preparation
    try:
        settings = Settings.from_env()
        problem = cannot_listen(settings.host, settings.port)  # before a preload can take minutes
        if problem is not None:
            raise SystemExit(listen_message(settings.host, settings.port, problem))
        demo = build_app(partial(real_factory, dtype=settings.dtype, numerics=settings.numerics), settings)
    except (ValueError, OSError, RuntimeError) as exc:  # a bad setting, or a preload that failed: say why and stop
        raise SystemExit(f"SpecExtend Studio cannot start: {exc}") from exc
    try:
        launch(demo, settings)
    except OSError:
        problem = cannot_listen(settings.host, settings.port)  # taken while the app was built
        if problem is None:
            raise
        raise SystemExit(listen_message(settings.host, settings.port, problem)) from None


if __name__ == "__main__":
    main()
