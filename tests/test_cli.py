"""The command line: knobs map onto the config, bad values fail with a message, and a run on tiny models
saved with the bundled tokenizer prints the text and a final JSON line with the promised fields."""

from __future__ import annotations

import io
import json

import pytest
from transformers import AutoTokenizer

from conftest import save_tiny_pair
from specextend.config import GPU_DRAFT, AttentionConfig, DraftConfig
from specextend.tools import bundled, prompting
from specextend.events import Finished, Prefilled, Prefilling, Started, Verified
from specextend.tools.cli import Progress, build_parser, config_from, main, workload


def args(*extra):
    return build_parser().parse_args(["generate", "--input", "x.txt", *extra])


def test_knobs_reach_the_config():
    config = config_from(args("--method", "streaming", "--k", "3", "--chunk-size", "16", "--working-cache", "256",
                              "--verify", "hybrid", "--temperature", "0.5", "--top-p", "0.9"), eos=(2,))
    assert config.method == "streaming" and config.draft.k == 3 and config.retrieval.top_k == 16
    assert config.attention.verify == "hybrid" and config.attention.prefill == "fused"
    assert config.temperature == 0.5 and config.top_p == 0.9 and config.eos_token_ids == (2,)
    assert config_from(args(), eos=()).attention.steps == "auto"  # the method's: captured on CUDA
    assert config_from(args("--method", "speculative"), eos=()).attention.steps == "eager"
    assert config_from(args("--steps", "static", "--verify", "onecall"), eos=()).attention == AttentionConfig(
        "fused", "onecall", "static")
    assert config_from(args("--no-cmr"), eos=()).draft_cache == "full"
    assert config_from(args(), eos=()).draft == DraftConfig(k=2)  # the CPU's defaults: a chain of config.CPU_CHAIN
    assert config_from(args("--k", "4"), eos=()).draft.k == 4  # a chain length given wins
    assert config_from(args(), eos=(), device_type="cuda").draft == GPU_DRAFT  # a GPU's, from its cost curve
    mixed = config_from(args("--draft-shape", "chain", "--k", "6"), eos=(), device_type="cuda").draft
    assert (mixed.shape, mixed.k, mixed.node_budget) == ("chain", 6, GPU_DRAFT.node_budget)
    assert config_from(args(), eos=()).draft_cache == "cmr"
    assert config_from(args(), eos=()).retrieval.signal == "default"
    assert config_from(args("--signal", "paper"), eos=()).retrieval.signal == "paper"
    own = config_from(args("--signal-layers", "3,-2", "--signal-rows", "16", "--signal-reserve", "0.25"), eos=()).retrieval
    assert (own.signal.layers, own.signal.rows, own.signal.combine, own.signal.reserve) == ((3, -2), 16, "mean", 0.25)
    assert config_from(args("--signal-layers", "all", "--signal-combine", "max"), eos=()).retrieval.signal.layers == ()


def test_the_numerics_flag_is_parsed_and_its_resolved_setting_reaches_the_config(capsys):
    assert args().numerics == "auto" and args("--numerics", "bf16-kv").numerics == "bf16-kv"
    assert config_from(args(), eos=()).attention.numerics == "fp32"  # the engine's default until a pair resolves it
    assert config_from(args(), eos=(), numerics="bf16-kv").attention.numerics == "bf16-kv"
    with pytest.raises(SystemExit):
        args("--numerics", "fp16")
    err = capsys.readouterr().err
    assert "argument --numerics: invalid choice: 'fp16'" in err and "bf16-kv" in err


def test_the_benchmark_and_the_race_timer_take_the_same_numerics_flag(capsys):
    from scripts import race_time
    from specextend.tools.bench.main import parse

    for read in (parse, race_time.parse):
        assert read([]).numerics == "auto" and read(["--numerics", "bf16"]).numerics == "bf16"
        with pytest.raises(SystemExit):
            read(["--numerics", "int8"])
        assert "argument --numerics: invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [(["--chunk-size", "0"], "chunk_size"), (["--top-k", "0"], "top_k"),
                                          (["--k", "0"], "k must"), (["--temperature", "-1"], "temperature"),
                                          (["--working-cache", "8"], "smaller than one chunk"),
                                          (["--node-budget", "0"], "node_budget"),
                                          (["--signal-rows", "0"], "rows"), (["--signal-reserve", "1.5"], "reserve"),
                                          (["--signal-layers", "middle"], "signal-layers")])
def test_nonsense_knobs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        config_from(args(*bad), eos=())


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), AutoTokenizer.from_pretrained(bundled.target_dir()))


def test_generate_prints_text_then_json(tiny_dirs, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("A long time ago the river flooded the valley. " * 40)
    trace = tmp_path / "trace.json"
    code = main(["generate", "--input", str(doc), "--method", "specextend", "--target", str(tiny_dirs[0]),
                 "--draft", str(tiny_dirs[1]), "--max-new-tokens", "12", "--chunk-size", "16", "--top-k", "4",
                 "--trace", str(trace), "--numerics", "bf16"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = json.loads(lines[-1])
    for key in ("method", "token_ids", "text", "decode_tokens_per_s", "e2e_tokens_per_s", "mean_accepted", "phase_seconds"):
        assert key in result
    assert result["method"] == "specextend" and 1 <= len(result["token_ids"]) <= 12
    assert result["numerics"] == result["config"]["attention"]["numerics"] == "bf16"
    assert json.loads(trace.read_text())[0]["type"] == "Started"


def test_long_output_writes_past_its_prompt_and_cmr_reads_the_output_back(tiny_dirs, tmp_path, capsys):
    assert config_from(args("--long-output"), eos=()).max_new_tokens == prompting.LONG_OUTPUT_TOKENS
    assert workload(args("--long-output"))[0] == prompting.LONG_OUTPUT_INSTRUCTION
    assert workload(args("--long-output", "--max-new-tokens", "5", "--instruction", "Go on.")) == ("Go on.", 5)
    assert workload(args()) == (prompting.DEFAULT_INSTRUCTION, 128)
    opening = tmp_path / "opening.txt"
    opening.write_text("The boat came in at dawn, low in the water.")
    trace = tmp_path / "trace.json"
    code = main(["generate", "--input", str(opening), "--long-output", "--target", str(tiny_dirs[0]),
                 "--draft", str(tiny_dirs[1]), "--max-new-tokens", "400", "--chunk-size", "16", "--top-k", "4",
                 "--retrieve-every", "2", "--trace", str(trace)])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prompt_len = result["prompt_tokens"]
    assert prompt_len < 100 and len(result["token_ids"]) > 5 * prompt_len  # the sequence grew by generation
    events = json.loads(trace.read_text())
    late = [e for e in events if e["type"] == "Retrieved" and e["seq_len"] > 4 * prompt_len]
    assert late and all(e["working_cache_len"] <= 4 * 16 for e in late)  # the budget holds as the output grows
    chosen = {e["chunk_spans"][i][0] for e in late for i in e["selected"]}
    assert any(start >= prompt_len for start in chosen)  # CMR kept chunks the model wrote itself


def test_errors_are_messages_not_tracebacks(tiny_dirs, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("   ")
    assert main(["generate", "--input", str(empty), "--target", str(tiny_dirs[0]), "--draft", str(tiny_dirs[1])]) == 2
    assert "empty" in capsys.readouterr().err
    long = tmp_path / "long.txt"
    long.write_text("word " * 3000)
    assert main(["generate", "--input", str(long), "--target", str(tiny_dirs[0]), "--draft", str(tiny_dirs[1]),
                 "--max-new-tokens", "100"]) == 2
    assert "exceeds the target's limit of 2048" in capsys.readouterr().err
    assert main(["generate", "--input", str(long), "--target", str(tiny_dirs[0]), "--draft", str(tiny_dirs[1]),
                 "--max-new-tokens", "4", "--truncate"]) == 0


def test_the_bundled_targets_first_preparation_is_reported_on_stderr(tmp_path, capsys, monkeypatch):
    def preparing(progress):
        progress("Downloading the target: 12 of ~93 MB")
        raise FileNotFoundError("the test stops here")

    monkeypatch.setattr(bundled, "default_pair", preparing)
    doc = tmp_path / "doc.txt"
    doc.write_text("The river flooded the valley. " * 20)
    assert main(["generate", "--input", str(doc)]) == 2
    printed = capsys.readouterr()
    assert printed.err.splitlines()[0] == "Downloading the target: 12 of ~93 MB" and printed.out == ""


def test_progress_tells_the_reading_and_the_decoding_from_the_events():
    out = io.StringIO()
    progress = Progress(out, every_s=1.0)
    config = {"max_new_tokens": 64}
    events = [Started(0.0, 0.0, "specextend", tuple(range(1200)), config, 2, 1, "cpu", "float32")]
    events += [Prefilling(t, t, "target", done, 1200) for t, done in ((1.0, 512), (1.5, 1024), (2.5, 1200))]
    events += [Prefilled(3.0, 3.0, 1200, 2.5, 0.5, 7)]
    events += [Verified(3.0 + 0.25 * s, 0.2, s, 1200 + 2 * s, (0,), (True,), 1, 9, (5, 9), 1 + 2 * s) for s in range(1, 9)]
    events += [Finished(5.2, 5.2, tuple(range(17)), "max_new_tokens", 8, 1200)]
    for event in events:
        progress(event)
    lines = out.getvalue().splitlines()
    assert lines[0] == "specextend: reading 1,200 prompt tokens on cpu"
    # the second block came 0.5 s after the first: within a second, so not shown; the last block always is
    assert lines[1] == "the target reads the prompt: block 1 of 3 (512 of 1,200 tokens), 512 tokens/s, about 1 s left"
    assert lines[2] == "the target reads the prompt: block 3 of 3 (1,200 of 1,200 tokens), 480 tokens/s"
    assert lines[3] == "the prompt read in 3.0 s; decoding"
    decoding = [line for line in lines if line.startswith("decoding:")]
    assert decoding[0] == "decoding: 3 of at most 64 tokens, 8.0 tokens/s, 2.00 tokens per step"
    assert len(decoding) == 2  # 8 steps over 2 s, a line a second at most
    assert lines[-1] == "finished (max_new_tokens): 17 tokens in 5 s, 8 steps"


def test_a_run_reports_progress_on_stderr_unless_quiet(tiny_dirs, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("The river rose over the valley and the mill. " * 120)  # three 512-token blocks
    run = ["generate", "--input", str(doc), "--target", str(tiny_dirs[0]), "--draft", str(tiny_dirs[1]),
           "--max-new-tokens", "8"]
    assert main(run) == 0
    printed = capsys.readouterr()
    assert "the target reads the prompt: block 3 of 3" in printed.err
    assert "the prompt read in" in printed.err and "decoding: " in printed.err and "tokens/s" in printed.err
    assert printed.err.splitlines()[-1].startswith("finished (")
    result = json.loads(printed.out.strip().splitlines()[-1])  # stdout: the text, then the JSON line, nothing else
    assert result["prompt_tokens"] > 1024
    assert main([*run, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and json.loads(quiet.out.strip().splitlines()[-1])["token_ids"] == result["token_ids"]
