"""Entry point: `python app.py` serves SpecExtend Studio (Hugging Face Spaces runs the same file).

On the default path the app works offline and sends no analytics: HF_HUB_OFFLINE=1 unless the operator
sets SPECEXTEND_HUB=1, and GRADIO_ANALYTICS_ENABLED=False. Both are set before gradio or transformers
are imported. It binds 127.0.0.1 unless GRADIO_SERVER_NAME says otherwise. See app/settings.py for
every variable.
"""

import logging
import os
from functools import partial

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
if os.environ.get("SPECEXTEND_HUB", "0").strip() != "1":
    os.environ["HF_HUB_OFFLINE"] = "1"

from app import Settings, build_app, launch, real_factory  # noqa: E402  (after the environment is set)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("app").setLevel(logging.INFO)  # the app's own progress (a preload), not every HTTP request
    try:
        settings = Settings.from_env()
        demo = build_app(partial(real_factory, dtype=settings.dtype), settings)
    except (ValueError, OSError, RuntimeError) as exc:  # a bad setting, or a preload that failed: say why and stop
        raise SystemExit(f"SpecExtend Studio cannot start: {exc}") from exc
    launch(demo, settings)


if __name__ == "__main__":
    main()
