"""The app through gradio_client, launched on 127.0.0.1 with a fake engine factory (no model): a run
streams every panel, bad input gets a clear message and the app keeps serving, Stop works mid-run,
two users share the queue, and an exported trace replays with no model."""

from __future__ import annotations

import html
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import astuple, replace
from pathlib import Path

import pytest

from app import Settings, build_app, documents, launch
from app.runner import Knobs, build_config
from app.settings import BUNDLED, BUNDLED_DRAFT_MODEL, parse_pairs
from app.trace import TraceError, loads
from app.updates import KEEP
from app.studio import DEFAULT_TASK
from specextend.events import Retrieved

from fixtures.fake_engine import fake_factory, fake_generate

ROOT = Path(__file__).parent.parent
DOC = " ".join(f"word{i}" for i in range(1500))
KNOBS = dict(max_new=48, chunk=32, top_k=6, every=3, shape="chain", k=4, depth=5, budget=12, temperature=0, seed=0)


def run_args(document=DOC, method="specextend", race=("speculative", "autoregressive"), pair=BUNDLED, **knobs):
    k = {**KNOBS, **knobs}
    return (document, "Summarize.", pair, method, list(race), "0.3", *k.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = Settings(port=free_port(), max_upload_bytes=4096, max_new_tokens=256, concurrency=1,
                        max_document_chars=20_000)
    demo = build_app(fake_factory(step_s=0.02, max_positions=2048), settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{settings.port}/"
    demo.close()


@pytest.fixture
def client(server):
    from gradio_client import Client

    return Client(server, verbose=False)


def file_path(value) -> str:
    """A file output's path, whether it came back as a path or as a component update."""
    return value["value"] if isinstance(value, dict) else value


def test_a_run_streams_every_panel_and_exports_a_replayable_trace(client):
    from gradio_client import handle_file

    job = client.submit(*run_args(), api_name="/run")
    status, status_text, output, exact, retrieval, far, acceptance, throughput, readout, download = job.result()
    assert "Done." in status and len(job.outputs()) >= 2  # streamed: several messages, the last carries all
    assert status_text.startswith("Done.\n") and "<" not in status_text  # the status as plain text, for API callers
    download = file_path(download)
    assert "se-draft" in output and "word" in output
    assert "✔ Exact" in exact and "(both in fp32 numerics)" in exact  # the fake pair's; a served pair's is its own
    runs, _, meta = loads(Path(download).read_text())
    assert list(runs) == ["specextend", "speculative", "autoregressive"] and meta["primary"] == "specextend"
    retrieval = json.loads(retrieval["plot"])
    steps = [e.step for e in runs["specextend"] if type(e).__name__ == "Retrieved"]
    assert retrieval["data"][1]["y"] == steps
    assert "Reaching back" in far and "accepted per step" in far  # the chunks CMR reached back for, listed
    acceptance = json.loads(acceptance["plot"])
    assert len(acceptance["data"][0]["x"]) == sum(type(e).__name__ == "Verified" for e in runs["specextend"])
    curves = [d for d in json.loads(throughput["plot"])["data"] if d["type"] == "scatter"]
    assert len(curves) == 3
    assert readout.count("<tr>") == 4

    replayed = client.predict(handle_file(download), "instant", "0.3", api_name="/replay")
    assert "Done." in replayed[0] and json.loads(replayed[4]["plot"])["data"][1]["y"] == steps


@pytest.mark.parametrize("args,message", [
    (run_args(document="   \n"), "The document is empty"),
    (run_args(top_k=1), "top-k chunks kept = 1 leaves no room"),
    (run_args(chunk=0), "chunk size must be at least 1"),
    (run_args(temperature=-1), "temperature must be between 0 (greedy) and 10"),
    (run_args(temperature=1e6), "temperature must be between 0 (greedy) and 10, got 1000000.0"),
    (run_args(seed=2**80), f"seed must be a whole number from 0 to {2**63 - 1}"),
    (run_args(document=" ".join(["long"] * 2100)), "exceeds the model's limit of 2,048 positions"),
])
def test_bad_input_gets_a_clear_message_and_the_app_keeps_serving(client, args, message):
    status = client.predict(*args, api_name="/run")[0]
    assert message in html.unescape(status), status
    assert "Done." in client.predict(*run_args(race=(), max_new=8), api_name="/run")[0]


@pytest.mark.parametrize("args,message", [
    (run_args(max_new=1000), "greater than maximum value 256"),
    (run_args(pair="someone/else+draft"), "someone/else+draft"),
])
def test_values_outside_a_component_are_refused_before_the_handler(client, args, message):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=re.escape(message)):
        client.predict(*args, api_name="/run")
    assert "Done." in client.predict(*run_args(race=(), max_new=8), api_name="/run")[0]


def test_uploads_are_checked(client, tmp_path):
    from gradio_client import handle_file

    cases = {
        "notes.txt": ("plain text, fine".encode(), None),
        "notes.md": ("# Titel\nÄrger über Größe".encode("utf-8"), None),
        "empty.txt": (b"  \n ", "The document is empty"),
        "binary.txt": (b"\x00\x01\x02abc", "binary file"),
        "latin1.txt": ("caf\xe9".encode("latin-1"), "not valid UTF-8"),
        "utf16.txt": ("héllo, wörld".encode("utf-16"), "is UTF-16 text; save it as UTF-8"),
        "utf16le.txt": ("hello, world, no byte-order mark".encode("utf-16-le"), "is UTF-16 text"),
        "utf32.txt": ("héllo".encode("utf-32"), "is UTF-32 text"),
        "big.txt": (b"x" * 5000, "accepts documents up to 4 KB"),
        "image.png": (b"\x89PNG", "not a .txt or .md file"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        if name == "image.png":  # the browser's file picker filters by type; the API still checks
            from app.documents import DocumentError, read_upload

            with pytest.raises(DocumentError, match=message):
                read_upload(path, 4096)
            continue
        text, info = client.predict(handle_file(str(path)), api_name="/upload")
        if message is None:
            assert text == data.decode("utf-8"), name
        else:
            assert message in info, (name, info)


def test_every_public_endpoint_takes_what_its_schema_describes(client, tmp_path):
    """Each endpoint /gradio_api/info lists, called with the values its own schema gives (each parameter's
    default, else its example; a local file where it takes a file), answers without a type error."""
    from gradio_client import handle_file

    api = client.view_api(print_info=False, return_format="dict")
    files = {"Uploadbutton": tmp_path / "doc.txt", "File": tmp_path / "trace.json"}  # a document, a trace
    files["Uploadbutton"].write_text("A short document about the sea. " * 20, encoding="utf-8")
    files["File"].write_text("[]", encoding="utf-8")
    public = set(api["named_endpoints"])
    assert {"/run", "/stop", "/replay", "/needle", "/needle_stop", "/upload"} <= public
    assert not any(name.startswith(("/document_info", "/pick_sample")) for name in public)  # the page's helpers
    for name, endpoint in api["named_endpoints"].items():
        args = []
        for p in endpoint["parameters"]:
            literal = re.match(r"Literal\['([^']*)'", p["python_type"]["type"])
            if "FileData" in json.dumps(p["type"]):
                args.append(handle_file(str(files[p["component"]])))
            elif literal:  # a choice, passed as the schema writes it: a string
                args.append(literal.group(1))
            else:
                args.append(p["parameter_default"] if p["parameter_has_default"] else p["example_input"])
        client.predict(*args, api_name=name)  # a value outside what the schema says raises AppError here


def test_an_oversized_text_is_refused_before_tokenizing(client):
    """Sent past the upload check (pasted or through the API), a long text is refused by its length alone: the
    run and the document readout both answer at once, and the server keeps serving."""
    started = time.perf_counter()
    status = client.predict(*run_args(document="word " * 6000), api_name="/run")[0]
    assert "30,000 characters" in status and "up to 20,000 characters" in status
    from app.studio import Studio

    studio = Studio(fake_factory(), Settings(max_document_chars=20_000))
    assert "up to 20,000 characters" in studio.document_info("word " * 6000, BUNDLED)  # the page's own readout
    assert time.perf_counter() - started < 10
    assert "Done." in client.predict(*run_args(race=(), max_new=8), api_name="/run")[0]


def test_stop_ends_a_run_midway(client):
    job = client.submit(*run_args(race=("autoregressive",), max_new=256), api_name="/run")
    while len(job.outputs()) < 2:  # streaming has begun
        time.sleep(0.05)
    client.predict(api_name="/stop")  # answers once the run has ended (it ends after the current step)
    status = job.result()[0]
    assert "Stopped, as asked" in status and "SpecExtend: stopped" in status
    assert "target alone: did not run (stopped)" in status  # the race's run that never began
    assert client.predict(api_name="/stop")[1] == "Nothing is running."


def test_two_users_at_once_share_the_queue(server):
    from gradio_client import Client

    clients = [Client(server, verbose=False) for _ in range(2)]
    jobs = [c.submit(*run_args(race=(), max_new=64), api_name="/run") for c in clients]
    results = [j.result(timeout=120) for j in jobs]
    assert all("Done." in r[0] for r in results)


def test_replay_refuses_files_that_are_not_traces(client, tmp_path):
    path = tmp_path / "nope.json"
    path.write_text('{"hello": 1}')
    from gradio_client import handle_file

    status = client.predict(handle_file(str(path)), "instant", "0.3", api_name="/replay")[0]
    assert "Cannot replay this file" in status and "not a SpecExtend trace" in status
    with pytest.raises(TraceError):
        loads("not json")


def test_knobs_build_the_method_presets():
    config = build_config("speculative", Knobs(max_new_tokens=10, k=3), eos_ids=(2,))
    assert config.draft_cache == "full" and config.attention.verify == "masked" and config.eos_token_ids == (2,)
    assert build_config("specextend", Knobs()).draft_cache == "cmr"
    with pytest.raises(ValueError, match="whole number"):
        build_config("specextend", Knobs(k=2.5))
    with pytest.raises(ValueError, match="capped at 256"):
        build_config("specextend", Knobs(max_new_tokens=1000), max_new_tokens_cap=256)


def test_the_chain_length_starts_at_the_serving_devices_default(monkeypatch):
    """config.default_chain for the device the models load on: 4 with CUDA, 2 on a CPU, for the page's knob (and so
    the named API's default), a click that leaves k out, and the needle tab's runs."""
    import torch

    from app.runner import serving_chain
    from app.studio import SessionState, Studio

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serving_chain() == Knobs().k == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serving_chain() == Knobs().k == 2
    page = build_app(fake_factory(), Settings()).config["components"]
    assert [c["props"]["value"] for c in page if c["props"].get("label") == "chain length k"] == [2]
    chains: list[int] = []

    def recording(choice, progress):
        loaded = fake_factory(step_s=0.0)(choice, progress)

        def generate(ids, config, *args, **kwargs):
            chains.append(config.draft.k)
            return loaded.generate(ids, config, *args, **kwargs)

        return replace(loaded, generate=generate)

    studio = Studio(recording, Settings())
    assert "Done." in list(studio_run(studio, SessionState(), max_new_tokens=8))[-1][1]
    assert "Done." in list(studio.needle(SessionState(), "hamlet_opening", 4000, 50, 0, 8, 8, BUNDLED))[-1][0]
    assert chains and set(chains) == {2}, chains
    assert "Done." in list(studio_run(studio, SessionState(), max_new_tokens=8, k=4))[-1][1]  # a chain typed in wins
    assert chains[-1] == 4


def test_settings_default_to_localhost_and_the_bundled_pairs_only():
    """The bundled target with its EAGLE-3 head first, then with its distilled draft model; nothing else unasked."""
    settings = Settings.from_env({})
    assert settings.host == "127.0.0.1" and [p.key for p in settings.pairs] == [BUNDLED, BUNDLED_DRAFT_MODEL]
    with pytest.raises(ValueError, match="allow-list"):
        settings.pair("meta-llama/Llama-3.1-8B-Instruct+meta-llama/Llama-3.2-1B-Instruct")
    allowed = Settings.from_env({"SPECEXTEND_PAIRS": "a/target+a/draft, b/t + b/d", "GRADIO_SERVER_NAME": "0.0.0.0"})
    assert allowed.host == "0.0.0.0" and allowed.pair("b/t+b/d").draft == "b/d"
    assert settings.max_document_chars == 400_000
    assert Settings.from_env({"SPECEXTEND_MAX_DOCUMENT_CHARS": "5000"}).max_document_chars == 5000
    assert Settings.from_env({}).numerics == "auto" and Settings.from_env({"SPECEXTEND_NUMERICS": " bf16 "}).numerics == "bf16"
    with pytest.raises(ValueError, match="target\\+draft"):
        parse_pairs("only-a-target")


def pair_dropdown(settings: Settings, factory=None) -> dict:
    demo = build_app(factory or fake_factory(), settings)
    return next(c for c in demo.get_config_file()["components"] if c.get("props", {}).get("elem_id") == "pair")["props"]


def test_a_preset_named_by_the_operator_is_offered_and_selected_and_the_bundled_pair_can_be_hidden():
    from app.settings import PRESETS

    env = {"SPECEXTEND_PAIRS": "qwen2.5-7b, vicuna-7b-16k", "SPECEXTEND_DEFAULT_PAIR": "qwen2.5-7b"}
    props = pair_dropdown(Settings.from_env(env))
    assert [key for _, key in props["choices"]] == [BUNDLED, BUNDLED_DRAFT_MODEL, "qwen2.5-7b", "vicuna-7b-16k"]
    assert props["value"] == "qwen2.5-7b" and PRESETS["qwen2.5-7b"].target == "Qwen/Qwen2.5-7B-Instruct"
    spaced = Settings.from_env({"SPECEXTEND_PAIRS": "a/t + a/d", "SPECEXTEND_DEFAULT_PAIR": " a/t + a/d "})
    assert spaced.default.key == "a/t+a/d"  # written as the operator likes, matched as the list has it
    hidden = pair_dropdown(Settings.from_env({**env, "SPECEXTEND_HIDE_BUNDLED": "1", "SPECEXTEND_DEFAULT_PAIR": ""}))
    assert [key for _, key in hidden["choices"]] == ["qwen2.5-7b", "vicuna-7b-16k"] and hidden["value"] == "qwen2.5-7b"
    for bad, message in (({"SPECEXTEND_HIDE_BUNDLED": "1"}, "no model pair to serve"),
                         ({"SPECEXTEND_DEFAULT_PAIR": "qwen3-8b"}, "not among the offered pairs"),
                         ({**env, "SPECEXTEND_HIDE_BUNDLED": "1", "SPECEXTEND_DEFAULT_PAIR": "bundled"},
                          "unset SPECEXTEND_HIDE_BUNDLED"),
                         ({"SPECEXTEND_PAIRS": "qwen9"}, "neither a preset"),
                         ({"SPECEXTEND_DTYPE": "int4"}, "SPECEXTEND_DTYPE"),
                         ({"SPECEXTEND_NUMERICS": "int8"},
                          "SPECEXTEND_NUMERICS must be one of auto, fp32, bf16, bf16-kv, got 'int8'"),
                         ({"SPECEXTEND_PRELOAD": "yes"}, "0 or 1")):
        with pytest.raises(ValueError, match=message):
            Settings.from_env(bad)


def test_preloading_loads_the_default_pair_before_serving_and_a_failure_stops_start_up():
    loads = []
    factory = fake_factory()

    def counting(choice, progress):
        loads.append(choice.key)
        return factory(choice, progress)

    settings = Settings.from_env({"SPECEXTEND_PAIRS": "a/t+a/d", "SPECEXTEND_DEFAULT_PAIR": "a/t+a/d",
                                  "SPECEXTEND_PRELOAD": "1"})
    assert pair_dropdown(settings, counting)["value"] == "a/t+a/d" and loads == ["a/t+a/d"]

    def failing(choice, progress):
        raise OSError("a/t is not in the local cache")

    with pytest.raises(OSError, match="not in the local cache"):
        build_app(failing, settings)


def test_the_servers_input_cap_refuses_a_longer_prompt_with_a_message():
    from app.studio import DEFAULT_TASK, SessionState, Studio

    studio = Studio(fake_factory(), Settings(max_input_tokens=40))
    out = list(studio.run(SessionState(), DOC, "Summarize.", BUNDLED, "specextend", [], "0.3", *KNOBS.values()))
    assert "this server reads inputs of up to 40 tokens" in html.unescape(out[-1][0])
    info = studio.document_info(DOC, BUNDLED)
    assert "this server reads prompts (the document, the template and the task) of up to 40 tokens" in info
    assert "too long" in info
    # a document just under the cap whose prompt is over it: the readout says so, as the run's refusal does
    words = studio.pairs.peek(Settings().pair(BUNDLED)).codec.count(DOC)
    near = Studio(fake_factory(), Settings(max_input_tokens=words + 2))
    refused = list(near.run(SessionState(), DOC, DEFAULT_TASK, BUNDLED, "specextend", [], "0.3", *KNOBS.values()))
    assert f"inputs of up to {words + 2:,} tokens" in html.unescape(refused[-1][0])
    assert "too long" in near.document_info(DOC, BUNDLED)


def test_a_prompt_of_exactly_the_cap_runs_and_the_readout_agrees():
    """The readout marks a prompt too long exactly when the run refuses it: at the cap it runs, one over it does not."""
    from app.studio import DEFAULT_TASK, SessionState, Studio

    def click(studio):
        return html.unescape(list(studio.run(SessionState(), DOC, DEFAULT_TASK, BUNDLED, "autoregressive", [], "0.3",
                                             *KNOBS.values()))[-1][0])

    probe = Studio(fake_factory(), Settings())
    click(probe)
    n = len(probe.pairs.peek(Settings().pair(BUNDLED)).codec.prompt(DOC, DEFAULT_TASK).ids)
    exact, under = Studio(fake_factory(), Settings(max_input_tokens=n)), Studio(fake_factory(), Settings(max_input_tokens=n - 1))
    assert "reads inputs of up to" not in click(exact) and "too long" not in exact.document_info(DOC, BUNDLED)
    assert f"reads inputs of up to {n - 1:,} tokens" in click(under) and "too long" in under.document_info(DOC, BUNDLED)


def test_launch_never_shares():
    seen = {}

    class Demo:
        def launch(self, **kwargs):
            seen.update(kwargs)

    launch(Demo(), Settings(), share=True)
    assert seen["share"] is False and seen["server_name"] == "127.0.0.1"


def test_importing_the_app_loads_no_model_and_the_entry_point_goes_offline():
    code = (
        "import importlib.util, os, sys\n"
        "spec = importlib.util.spec_from_file_location('entry', 'app.py')\n"
        "entry = importlib.util.module_from_spec(spec); spec.loader.exec_module(entry)\n"
        "assert os.environ['HF_HUB_OFFLINE'] == '1' and os.environ['GRADIO_ANALYTICS_ENABLED'] == 'False'\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'a model library was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "GRADIO_ANALYTICS_ENABLED", "SPECEXTEND_HUB")}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=120)


def test_traces_round_trip_and_plain_engine_traces_replay():
    from specextend import events as ev
    from specextend.config import preset

    from app.trace import dumps
    from fixtures.fake_engine import fake_generate

    runs = {"specextend": list(fake_generate(list(range(5, 400)), preset("specextend", max_new_tokens=20)))}
    back, codec, meta = loads(dumps(runs, lambda ids: "".join(f"<{i}>" for i in ids), {"primary": "specextend"}))
    same = ev.dumps(runs["specextend"])  # JSON form: Started.config's tuples come back as lists
    assert ev.dumps(back["specextend"]) == same and meta == {"primary": "specextend"} and codec.decode([7, 8]) == "<7><8>"
    plain, codec, _ = loads(same)
    assert ev.dumps(plain["specextend"]) == same and codec.decode([7]) == "⟨7⟩"
    with pytest.raises(TraceError, match="holds no events"):
        loads('{"format": "specextend-studio-trace/1", "runs": {}}')


def test_needle_tab_runs_cmr_and_streaming_on_a_planted_fact(client):
    status, _, info, grid, answers, heads, cmr, paper, streaming = client.predict(
        "hamlet_opening", 4000, 50, 0, 8, 12, BUNDLED, api_name="/needle")
    assert "Done." in status and "Needle" in info and "Question" in info
    heat = json.loads(grid["plot"])["data"][0]
    assert heat["y"] == ["CMR, default signal", "CMR, paper signal", "StreamingLLM draft cache"] and len(heat["x"]) >= 2
    assert "Expected answer" in answers and answers.count("<tr>") == 4
    assert "attention" in json.loads(heads["plot"])["layout"]["annotations"][0]["text"]  # the fake engine has none
    for panel in (cmr, paper, streaming):
        assert any(a["text"].endswith("needle") for a in json.loads(panel["plot"])["layout"]["annotations"])


def test_messages_escape_what_the_user_controls(tmp_path):
    from app.studio import Studio

    studio = Studio(fake_factory(), Settings())
    path = tmp_path / "<img src=x onerror=alert(1)>.txt"
    path.write_bytes(b"\xff\xfe bad")
    _, info = studio.upload(str(path))
    assert "<img" not in info and "&lt;img" in info
    assert "<script>" not in studio.document_info("text", "<script>alert(1)</script>")


def test_a_run_stopped_during_prefill_still_draws():
    from specextend.config import preset

    from app.panels import main_view
    from fixtures.fake_engine import fake_generate

    stop = threading.Event()
    events = []
    for event in fake_generate(list(range(10, 5000)), preset("specextend"), stop):
        events.append(event)
        if type(event).__name__ == "Prefilling":
            stop.set()  # Stop pressed while the prompt is being read
    assert type(events[-1]).__name__ == "Finished" and events[-1].stop_reason == "stopped"
    view = main_view({"specextend": events}, "specextend", lambda ids: "x" * len(ids))
    assert "stopped" in view.output and view.retrieval["data"] == [] and view.acceptance["data"] == []


def test_codec_tokenizes_with_the_chat_template_and_finds_the_document_and_the_needle():
    from specextend.tools.bundled import target_dir

    from app.backend import Codec
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir()))  # the pair's tokenizer and chat template
    codec = Codec(tokenizer)
    needle = "The magic number of Doctor Pym is 4242."
    document = f"Once upon a time there was a long story. {needle} It went on and on, for pages and pages."
    prompt = codec.prompt(document, "What is the magic number of Doctor Pym?", marks={"needle": needle})
    messages = [{"role": "user", "content": f"{document}\n\nWhat is the magic number of Doctor Pym?"}]
    reference = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    reference = reference["input_ids"] if isinstance(reference, dict) or hasattr(reference, "keys") else reference
    assert prompt.ids == list(reference)
    a, b = prompt.document_span
    assert codec.decode(prompt.ids[a:b]).strip() == document
    a, b = prompt.marks["needle"]
    assert needle in codec.decode(prompt.ids[a:b]) and len(codec.decode(prompt.ids[a:b])) <= len(needle) + 2
    assert codec.eos_ids and "<|im_end|>" not in codec.text(prompt.ids) and "<|im_end|>" in codec.decode(prompt.ids)


def test_the_status_line_speaks_to_the_user_and_the_page_names_its_caps(client):
    """Drawing telemetry is folded under a details toggle, not in the status line; the max-new-tokens slider
    names the server's cap rather than clamping silently."""
    status = client.predict(*run_args(race=(), max_new=8), api_name="/run")[0]
    line, _, details = status.partition("<details")
    assert "Done." in line and "panels redrawn" not in line and "panels redrawn" in details
    slider = next(c for c in client.config["components"] if c.get("props", {}).get("elem_id") == "max-new")
    assert slider["props"]["maximum"] == 256 and "up to 256 on this server" in slider["props"]["info"]


def test_a_click_that_must_wait_is_told_how_long():
    """The status a click shows at once: a free slot, or the runs holding the slots and, from how long recent runs
    took, when one should free."""
    from app.runner import Job
    from app.studio import Studio

    studio = Studio(fake_factory(), Settings(concurrency=1))
    assert "a slot is free" in studio.queued()
    now = time.perf_counter()
    for took in (40.0, 50.0, 60.0):
        finished = Job([], None, None, began=now - 100 - took, ended=now - 100)
        finished.done.set()
        studio.generations.append(finished)
    studio.generations.append(Job([], None, None, began=now - 20))  # running for 20 s
    status = html.unescape(studio.queued())
    assert "1 run(s) in progress" in status and "about 50 s" in status and "free in about 30 s" in status


def test_a_refused_click_is_answered_at_once_and_goes_no_further():
    """Run's click is checked outside the queue: an empty document is refused there, while another tab's run holds
    the only slot, with the panels cleared and the click's chain ended (`go_on`); a valid click gets the queue's word
    and goes on to its queued run."""
    import gradio as gr

    from app.studio import SessionState, Studio
    from app.ui import gradio_answer

    studio = Studio(fake_factory(step_s=0.02), Settings(concurrency=1))
    other = SessionState()
    stream = studio_run(studio, other, max_new_tokens=120)
    next(stream)  # the other tab's run holds the slot
    state, click = SessionState(), (DEFAULT_TASK, BUNDLED, "specextend", [], "0", *astuple(Knobs()), "document")
    refused = studio.check(state, " ", *click)
    assert "The document is empty" in refused[1] and "Nothing was generated" in refused[2] and refused[-1] is None
    with pytest.raises(gr.Error):  # the chain ends: gradio runs no event chained after one that raised
        gradio_answer(studio.go_on(state))
    waiting = studio.check(state, DOC, *click)
    assert "Waiting for a free slot" in html.unescape(waiting[0]) and all(v is KEEP for v in waiting[1:])
    assert studio.go_on(state) is None  # the click goes on to its queued run
    nonsense = studio.check(state, DOC, *click[:5], *astuple(Knobs(top_k=-3)), "document")
    assert "top_k" in nonsense[1] or "chunks" in nonsense[1], nonsense[1]
    other.stop()
    list(stream)


def test_the_app_stops_where_the_cli_stops():
    """A chat model ends its turn with ids its generation config lists beside the tokenizer's end of text: the
    app's codec stops on all of them, as the CLI does."""
    from types import SimpleNamespace

    from app.backend import Codec
    from specextend.tools.prompting import stop_ids

    tokenizer = SimpleNamespace(eos_token_id=2)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 9]), config=SimpleNamespace(eos_token_id=2))
    assert Codec(tokenizer, stop_ids(tokenizer, model)).eos_ids == (2, 7, 9)
    assert Codec(tokenizer).eos_ids == (2,)  # the fake engine's codec: the tokenizer's alone


def test_runs_finishing_at_once_export_their_traces_without_losing_one(monkeypatch):
    """Eight runs export at once, over and over: each gets its own file, none fails, and the newest KEEP_TRACES stay
    (a sweep of old traces while another run wrote had failed one run with 'No such file or directory')."""
    from app import studio as studio_module
    from app.studio import Studio

    monkeypatch.setattr(studio_module, "KEEP_TRACES", 5)
    studio = Studio(fake_factory(), Settings())
    config = build_config("autoregressive", Knobs(max_new_tokens=4))
    events = {"autoregressive": list(fake_generate(list(range(100, 140)), config))}
    paths, errors = [], []

    def export():
        for _ in range(10):
            try:
                paths.append(studio._export(events, lambda ids: "x" * len(ids), {}))
            except OSError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=export) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 80
    kept = sorted(studio.trace_dir.glob("*.json"))
    assert len(kept) == 5 and {str(p) for p in kept} == set(sorted(paths, key=lambda p: int(p[:-5].rsplit("-", 1)[1]))[-5:])


def drive(handler, *args) -> list[tuple]:
    """Every message a streaming handler yields, to its end."""
    return list(handler(*args))


def studio_run(studio, state, **overrides):
    """A direct call of the Studio's run handler with the test's knobs, by the API's parameter names."""
    args = dict(document=DOC, task="Summarize.", pair=BUNDLED, method="specextend", race=[], chart_every="0",
                max_new_tokens=48, top_k=6, retrieve_every=3)
    return studio.run(state, **{**args, **overrides})


def test_run_pressed_during_a_run_says_a_run_is_going_until_it_ends():
    """The page ignores Run while this tab's run goes; the click's immediate answer says so, and the notice stays
    in the status lines the run streams (progress lines must not overwrite it) until the run ends."""
    from app.studio import RUN_IS_GOING, SessionState, Studio

    studio = Studio(fake_factory(step_s=0.02), Settings())
    state = SessionState()
    stream = studio_run(studio, state, max_new_tokens=120)
    first = next(stream)
    assert RUN_IS_GOING not in html.unescape(first[0])
    assert RUN_IS_GOING in html.unescape(studio.queued(state))  # the click's answer, at once
    rest = list(stream)
    live = [html.unescape(m[0]) for m in rest[:-1]]
    assert live and all(RUN_IS_GOING in s for s in live)  # every progress message keeps it
    assert "Done." in rest[-1][0] and RUN_IS_GOING not in html.unescape(rest[-1][0])
    assert "a slot is free" in studio.queued(state)  # once ended, a click starts a run again


def test_the_notice_reaches_the_page_at_once_whatever_the_redraw_pace():
    """A redraw computed just before Run's second click could land after the click's answer and hide it; the run's
    stream then carries the notice only at its next redraw, which a slow pace (a busy machine makes drawing cost more
    and redraws rarer) can put minutes away. The notice wakes the stream: its next message comes at once and says it."""
    from app.studio import RUN_IS_GOING, SessionState, Studio

    studio = Studio(fake_factory(step_s=0.02), Settings(redraw_s=600.0))
    state = SessionState()
    stream = studio_run(studio, state, max_new_tokens=2000)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(next(stream)), daemon=True)
    reader.start()  # the stream starts the run, then waits for its first redraw
    while state.job is None:
        time.sleep(0.01)
    studio.queued(state)
    reader.join(timeout=60)  # not the redraw pause (600 s): the notice woke it
    assert got and RUN_IS_GOING in html.unescape(got[0][0])
    state.stop()
    assert "Stopped, as asked" in list(stream)[-1][0]


def test_stop_is_said_until_the_run_ends_and_then_the_end_is_said(monkeypatch):
    """Once Stop is pressed no progress line replaces "Stopping" while the run winds down; the run's last message
    says it stopped as asked; Stop's own answer is "Stopping" only while the run has not ended (else it leaves the
    run's last word in place), so it can never land after that word and stay."""
    from app import studio as studio_module
    from app.studio import STOPPING, SessionState, Studio

    studio = Studio(fake_factory(step_s=0.05), Settings())
    state = SessionState()
    stream = studio_run(studio, state, max_new_tokens=200, race=["autoregressive"])
    next(stream)
    next(stream)
    monkeypatch.setattr(studio_module, "STOP_WAIT_S", 0.0)  # answer at once, before the run has wound down
    assert STOPPING in html.unescape(studio.stop(state)[0]) and studio.stop(state)[1] == STOPPING
    after = [html.unescape(m[0]) for m in stream]
    assert all("tokens generated" not in s and "prefill" not in s for s in after), after
    assert "Stopped, as asked" in after[-1] and "Done." not in after[-1]
    monkeypatch.setattr(studio_module, "STOP_WAIT_S", 5.0)
    stream = studio_run(studio, state, max_new_tokens=200)
    next(stream)
    answer = studio.stop(state)  # the run ends within the wait: Stop leaves the run's own last word
    assert state.job.done.is_set() and all(type(a).__name__ == "Keep" for a in answer)
    assert "Stopped, as asked" in html.unescape(list(stream)[-1][0])
    assert "Nothing is running" in studio.stop(state)[0]


def test_a_refused_run_leaves_no_waiting_text(client):
    """A prompt over the model's limit is refused once the model is loaded: the output panel then says nothing was
    generated, not that the run is waiting to start."""
    status, _, output = client.predict(*run_args(document=" ".join(["long"] * 2100)), api_name="/run")[:3]
    assert "exceeds the model's limit" in html.unescape(status)
    assert "Nothing was generated" in output and "waiting" not in output


def test_the_api_names_every_parameter_and_output_and_refuses_in_the_pages_words(client):
    """`/run`'s knobs are named as the page's controls are, not param_7..., its outputs by their panels, not
    value_17...; a refused knob is named as the page labels it (not the engine's field name)."""
    from app.studio import KNOB_NAMES

    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    run = [p["parameter_name"] for p in api["/run"]["parameters"]]
    assert run == ["document", "task", "pair", "method", "race", "chart_every", *KNOB_NAMES, "workload"]
    for name, endpoint in api.items():
        assert not any(p["parameter_name"].startswith("param_") for p in endpoint["parameters"]), name
        assert not any((r.get("label") or "value_").startswith("value_") for r in endpoint["returns"]), name
    assert [r["label"] for r in api["/run"]["returns"]][:4] == ["status", "status_text", "output", "exactness"]
    status = client.predict(document=DOC, chunk_size=0, api_name="/run")[0]
    assert "chunk size must be at least 1 token" in status and "chunk_size" not in status
    status = client.predict(document=DOC, top_k=1, api_name="/run")[0]
    assert "top-k chunks kept" in status and "top_k" not in status
    from app.studio import SessionState, Studio

    studio = Studio(fake_factory(), Settings())  # past the page's own checks (its list of haystacks, its sliders)
    for args, said in ((("no-such-text", 4000, 50, 0, 8, 12), "no bundled document named 'no-such-text'"),
                       (("hamlet_opening", None, 50, 0, 8, 12), "haystack length must be a whole number"),
                       (("hamlet_opening", 4000, float("nan"), 0, 8, 12), "needle depth is a share"),
                       (("hamlet_opening", 4000, 50, 0, 8, float("inf")), "max new tokens must be a whole number")):
        assert said in html.unescape(drive(studio.needle, SessionState(), *args)[-1][0])


def test_a_long_output_writes_thousands_of_tokens_from_a_short_prompt_and_cmr_reads_the_output_back(client):
    """The long-output workload through the API: a short prompt, 2,000+ new tokens (this server allows them), the
    race; the trace says which workload ran, and CMR's late retrievals keep chunks of the output."""
    from app.studio import Studio

    studio = Studio(fake_factory(), Settings(max_new_tokens=3000))
    sample, prompts, box, task, tokens = studio.choose_workload("long_output")
    assert (sample.visible, prompts.visible, box.label, tokens) == (False, True, "Prompt", 2048)
    assert "at length" in task and studio.choose_workload("document")[3] == DEFAULT_TASK
    assert Studio(fake_factory(), Settings(max_new_tokens=500)).choose_workload("long_output")[4] == 500  # the cap
    text, instruction = studio.pick_prompt(documents.prompts()[0][1])
    assert 100 < len(text) < 1000 and instruction
    short = " ".join(f"word{i}" for i in range(60))
    result = client.predict(short, instruction, BUNDLED, "specextend", ["speculative"], "0", 250, 16, 4, 2, "chain", 4, 5,
                            12, 0, 0, True, "default", "long_output", api_name="/run")
    status, download = result[0], file_path(result[-1])
    assert "Done." in status
    runs, _, meta = loads(Path(download).read_text())
    assert meta["workload"] == "long_output" and set(runs) == {"specextend", "speculative"}
    finished = runs["specextend"][-1]
    assert len(finished.token_ids) == 250 and finished.prompt_len < 100
    late = [e for e in runs["specextend"] if isinstance(e, Retrieved) and e.seq_len > 3 * finished.prompt_len]
    assert late and any(e.chunk_spans[i][0] >= finished.prompt_len for e in late for i in e.selected)
    from app.studio import SessionState

    refused = list(studio_run(studio, SessionState(), workload="poem"))  # the page's radio offers no such choice
    assert len(refused) == 1 and "the workload is 'document'" in html.unescape(refused[0][0])


def test_each_tab_owns_its_runs():
    """The Long-document tab and the needle tab hold separate session states: a needle run neither stops the main
    run nor shows in its step control, and each tab's Stop reaches its own run only."""
    demo = build_app(fake_factory(), Settings())
    config = demo.config
    deps = {d["api_name"]: d for d in config["dependencies"] if d.get("api_name")}
    states = {c["id"] for c in config["components"] if c["type"] == "state"}
    first = lambda name: [i for i in deps[name]["inputs"] if i in states]  # noqa: E731
    assert len(first("run")) == len(first("needle")) == 1 and first("run") != first("needle")
    assert first("stop") == first("run") and first("needle_stop") == first("needle")
    assert first("replay") == first("run")  # a replay is stepped through on the Long-document tab


def test_the_step_control_follows_keys_and_typing_and_ids_are_unique():
    """The slider's `input` event (keys, typing, dragging) redraws the panels, not only its release; no two
    components share an element id (a gradio Group renders its elem_id twice, so the step control is a Column)."""
    demo = build_app(fake_factory(), Settings())
    config = demo.config
    slider = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "step-slider")
    events = [t for d in config["dependencies"] for t in d["targets"] if t[0] == slider["id"]]
    assert ("input" in {e for _, e in events}) and "release" not in {e for _, e in events}
    ids = [c["props"]["elem_id"] for c in config["components"] if c.get("props", {}).get("elem_id")]
    assert len(ids) == len(set(ids))
    stepper = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "stepper")
    assert stepper["type"] == "column"


def test_the_from_python_example_in_the_docs_runs_as_written(server, monkeypatch, capsys):
    """docs/APP.md's gradio_client example, run as it is written there (only the address is this test server's)."""
    text = (ROOT / "docs" / "APP.md").read_text(encoding="utf-8")
    section = text.split("## From Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'Client("http://127.0.0.1:7860/")' in code
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    exec(compile(code.replace("http://127.0.0.1:7860/", server), "docs/APP.md", "exec"), scope)
    assert "Done." in capsys.readouterr().out
    assert "✔ Exact" in scope["exactness"] and len(scope["charts"]) == 4
    runs, _, _ = loads(Path(scope["trace"]).read_text())  # a file, downloaded by gradio_client
    assert list(runs) == ["specextend", "autoregressive"]
    assert "Done." in scope["status_text"] and "Replay of a trace recorded on 20" in scope["replayed"][1]


def test_the_status_says_what_the_prompt_is_read_in_and_the_numerics():
    from app.runner import describe
    from specextend.events import Started

    began = Started(0.0, 0.0, "specextend", (1, 2, 3), {}, 30, 2, "cpu", "float32", prefill_dtype="bfloat16")
    assert ("started on cpu (float32, fp32 numerics; the prompt read in bfloat16), reading 3 prompt tokens"
            in describe("specextend", began))  # a config without numerics (a trace from before them): fp32
    packed = Started(0.0, 0.0, "specextend", (1,), {"attention": {"numerics": "bf16-kv"}}, 30, 2, "cpu", "float32")
    assert "(float32, bf16-kv numerics)" in describe("specextend", packed)


def test_the_trace_output_is_a_file_that_replay_takes_back_through_gradio_client(client):
    """`/run`'s `trace` comes back as a file gradio_client downloads (a local path, not an update holding the server's
    path) and `/replay` takes it back through handle_file: the replay draws the same runs and says whose trace it is."""
    from gradio_client import handle_file

    result = client.predict(document=DOC, race=["autoregressive"], max_new_tokens=12, api_name="/run")
    status_text, trace = result[1], result[-1]
    assert isinstance(trace, str) and Path(trace).is_file(), trace
    runs, _, meta = loads(Path(trace).read_text())
    assert list(runs) == ["specextend", "autoregressive"] and meta["recorded"].endswith("UTC")
    replayed = client.predict(trace=handle_file(trace), pace="instant", api_name="/replay")
    assert replayed[1].startswith("Done.\n") and f"Replay of a trace recorded on {meta['recorded']}, " in replayed[1]
    assert replayed[2].count("se-about") == 1 and "Done." in status_text
    again, _, _ = loads(Path(replayed[-1]).read_text())  # a replay exports its trace too, as a file
    assert [len(e) for e in again.values()] == [len(e) for e in runs.values()]


def test_only_the_public_endpoints_are_listed():
    """The API lists the page's six endpoints and nothing else: no endpoint per session state (gradio made one for a
    State given a class), no helper of the page."""
    from gradio_client import Client

    settings = Settings(port=free_port())
    demo = build_app(fake_factory(), settings)
    launch(demo, settings, prevent_thread_lock=True, quiet=True)
    try:
        api = Client(f"http://127.0.0.1:{settings.port}/", verbose=False).view_api(print_info=False,
                                                                                 return_format="dict")
    finally:
        demo.close()
    assert set(api["named_endpoints"]) == {"/run", "/stop", "/replay", "/needle", "/needle_stop", "/upload"}
    assert not api["unnamed_endpoints"]
    for name in ("/run", "/replay", "/stop", "/needle", "/needle_stop"):
        assert [r["label"] for r in api["named_endpoints"][name]["returns"]][:2] == ["status", "status_text"], name


def test_gradios_own_refusals_are_one_line_in_the_log_not_a_traceback(client, capfd, caplog):
    """Values gradio refuses before the app sees them (more new tokens than the cap; an update dict where /replay
    takes a file, as /run's trace output once was) answer the caller with gradio's message and log one line each."""
    import logging

    from gradio_client.exceptions import AppError

    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="app.ui"):
        with pytest.raises(AppError, match="greater than maximum value 256"):
            client.predict(*run_args(max_new=1000), api_name="/run")
        with pytest.raises(AppError, match="FileData"):
            client.predict({"visible": True, "value": "/tmp/x.json", "__type__": "update"}, "instant", "0.3",
                           api_name="/replay")
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a request")]
    assert len(refused) == 2 and all("\n" not in line for line in refused), refused
    assert "run" in refused[0] and "greater than maximum value 256" in refused[0]


def test_a_fraction_in_a_whole_number_knob_is_refused_not_rounded(client):
    """1.5 typed as the chunk size (or any whole-number knob) reaches the Studio as typed and is refused with the
    knob's name; the page's number boxes do not round it first (they did: 1.5 ran as 2)."""
    for knob, label in (("chunk_size", "chunk size"), ("top_k", "top-k chunks"), ("k", "chain length k"),
                        ("seed", "seed")):
        status_text = client.predict(document=DOC, race=[], max_new_tokens=8, **{knob: 1.5}, api_name="/run")[1]
        assert f"{label} must be a whole number, got 1.5" in status_text, (knob, status_text)
    config = build_app(fake_factory(), Settings()).config
    boxes = [c for c in config["components"] if c["type"] == "number"]
    assert boxes and all(c["props"].get("precision") is None for c in boxes)


@pytest.mark.parametrize("document", ["x", "Hello there.", " ".join(["word"] * 19)])
def test_a_document_too_short_to_read_is_refused_with_a_clear_message(document):
    """The long-input workload reads a document: one of fewer than 20 words is refused before any model loads (it
    ran, and the model "summarised" one character); a short prompt is the long-output workload's, and runs there."""
    from app.studio import SessionState, Studio

    studio = Studio(fake_factory(), Settings())
    said = list(studio_run(studio, SessionState(), document=document))
    assert len(said) == 1 and "the long-input workload reads a document of at least 20 words" in said[0][1]
    assert "choose the long-output workload" in said[0][1] and studio.pairs.peek(Settings().pair(BUNDLED)) is None
    long = list(studio_run(studio, SessionState(), document=document + " and on", workload="long_output",
                           max_new_tokens=8))
    assert "Done." in long[-1][1]


def test_a_refused_click_clears_the_previous_runs_panels_and_a_new_input_clears_the_refusal():
    """After a run, a refused click leaves no panel showing that run (each says nothing ran), no step control and
    no trace; once the document, the sample, an upload or the workload changes, the refusal gives way to "Ready".
    A click refused by its job (a prompt over the model's limit) is cleared the same way; any other status stays."""
    from app.studio import READY, SessionState, Studio

    studio = Studio(fake_factory(max_positions=2048), Settings())
    state = SessionState()
    assert "Done." in list(studio_run(studio, state, max_new_tokens=8))[-1][1]
    assert studio.stepper(state)[0].visible and all(type(a).__name__ == "Keep" for a in studio.input_changed(state))
    refused = list(studio_run(studio, state, document="  "))
    status, status_text, output, exact, retrieval, far, acceptance, speed, table, trace = refused[-1]
    assert status_text.startswith("The document is empty") and "Nothing was generated" in output
    assert exact == far == table == "" and trace is None
    for figure in (retrieval, acceptance, speed):
        assert "nothing ran" in figure.json.decode()
    assert studio.stepper(state)[0].visible is False and studio.stepper(state)[-1].visible is False
    status, status_text = studio.input_changed(state)
    assert status_text == READY and READY in html.unescape(status)
    assert all(type(a).__name__ == "Keep" for a in studio.input_changed(state))  # said once
    over = list(studio_run(studio, state, document=" ".join(["long"] * 2100)))
    assert "exceeds the model's limit" in over[-1][1] and "Nothing was generated" in over[-1][2]
    assert studio.input_changed(state)[1] == READY


def test_a_run_stopped_in_its_prefill_says_so_in_every_panel():
    """Stopped while the target reads the prompt: the output, retrieval and acceptance panels say the run was stopped
    before its first token, retrieval and step (not that they wait for one); the speed table gives the time the run
    took (its prefill counts) and marks the race's runs that never began as not run; the exactness line says the
    target alone did not run (it does not ask to tick it: it is ticked); the step control says there is no step."""
    from app.studio import SessionState, Studio

    studio = Studio(fake_factory(step_s=0.4), Settings())
    state = SessionState()
    stream = studio_run(studio, state, document=" ".join(f"word{i}" for i in range(5000)), race=["speculative",
                        "autoregressive"])
    next(stream)
    while not any(type(e).__name__ == "Prefilling" for e in state.job.snapshot().get("specextend", [])):
        time.sleep(0.05)
    state.stop()
    *_, last = stream
    status, status_text, output, exact, retrieval, far, acceptance, speed, table, trace = last
    assert "stopped before the first token, during the prefill" in output and "waiting" not in output
    assert "stopped before the first retrieval" in retrieval.json.decode()
    assert "stopped before the first step" in acceptance.json.decode()
    assert "stopped before the first token" in speed.json.decode()  # no empty axes
    assert "did not run (stopped)" in exact and "tick" not in exact
    took = re.search(r"<td>stopped</td><td>0</td><td>([0-9.]+) s</td>", table)
    assert took and float(took.group(1)) >= 0.4, table  # at least one prefill block's time
    assert table.count("did not run (stopped)") == 2 and "0.00 s" not in table
    assert "target alone: did not run (stopped)" in status_text
    words = studio.stepper(state)[3]
    assert "Stopped before the first step" in words and "Step 0 of 0" not in words


def test_the_sample_list_and_the_document_readout_count_the_same_tokens():
    """The readout counts the document alone, as the sample list does (the bundled target's tokenizer, without the
    chat template): before the model loads it gives the sample's count, not an estimate from its characters, and once
    loaded it counts with the pair's tokenizer, which for the bundled pair is the same number."""
    import dataclasses

    from transformers import AutoTokenizer

    from app.backend import Codec
    from app.studio import Studio
    from specextend.tools.bundled import target_dir

    name, label = documents.samples()[0][1], documents.samples()[0][0]
    listed = int(re.search(r"~([0-9,]+) tokens", label).group(1).replace(",", ""))
    text = documents.sample_text(name)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir()))
    fake = fake_factory()

    def factory(choice, progress):  # the fake engine with the bundled target's tokenizer
        return dataclasses.replace(fake(choice, progress), codec=Codec(tokenizer))

    studio = Studio(factory, Settings())
    before = html.unescape(studio.document_info(text, BUNDLED))
    assert f"{listed:,} tokens in the document" in before and "about" not in before
    studio.pairs.get(Settings().pair(BUNDLED), lambda message: None)
    after = html.unescape(studio.document_info(text, BUNDLED))
    assert f"{listed:,} tokens in the document" in after and "in the prompt, with the chat template" in after
    pasted = studio.document_info("a pasted text", BUNDLED_DRAFT_MODEL)  # not a sample, that pair not loaded
    assert "about 3 tokens in the document (estimated at four characters a token" in pasted


def test_the_page_opens_with_a_sample_chosen_so_run_runs_at_once():
    """As the page opens, the first sample is selected, its text is in the document box, the readout counts it and
    the status says Run will run it; Run on those defaults starts a run (it answered "The document is empty")."""
    from app.studio import READY, SessionState, Studio

    config = build_app(fake_factory(), Settings()).config
    props = {c["props"].get("elem_id"): c["props"] for c in config["components"] if c["props"].get("elem_id")}
    first = documents.samples()[0][1]
    assert props["sample"]["value"] == first and props["document"]["value"] == documents.sample_text(first)
    assert "tokens in the document" in props["doc-info"]["value"] and READY in html.unescape(props["status"]["value"])
    studio = Studio(fake_factory(), Settings())
    said = list(studio_run(studio, SessionState(), document=props["document"]["value"], task=DEFAULT_TASK,
                           max_new_tokens=8))
    assert "Done." in said[-1][1]
