"""The benchmark's report as files: JSON, CSV, Markdown tables, the figures (drawn by visualizers.bench) as HTML
and PNG, and the console table."""

from __future__ import annotations

import csv
import importlib.util
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path

from visualizers.bench import figures

from ...metrics import PHASES
from .inputs import BASELINES
from .runs import Spread


# ---------------------------------------------------------------- output


def plain(value):
    """The report as JSON values: records through their to_json() (or their fields), recursively."""
    if hasattr(value, "to_json"):
        return plain(value.to_json())
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def flat(row: dict, prefix: str = "") -> dict:
    """A row with nested spreads, dicts and lists flattened for CSV."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}_"))
        elif isinstance(value, list):
            out[name] = ";".join(f"{v:.4g}" for v in value)
        else:
            out[name] = value
    return out


def write_csv(rows: list, path: Path) -> None:
    rows = [flat(plain(r)) for r in rows]
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)



def write_outputs(report: dict, out: Path) -> list[str]:
    """Write the report: its JSON and tables first, then its figures (visualizers.bench). A figure
    that cannot be drawn or saved is reported (in `report["figure_errors"]`, and returned), never fatal: what the run
    computed is on disk before any figure is tried, and the JSON is written again with the figures' files."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(report["cells"], out / "bench.csv")
    files = ["bench.json", "bench.csv", "bench.md"]
    if report.get("sweep"):
        write_csv(report["sweep"], out / "sweep.csv")
        files.append("sweep.csv")
    if report.get("long_output"):
        write_csv(report["long_output"].rows, out / "long_output.csv")
        files.append("long_output.csv")
    (out / "bench.md").write_text(markdown(report))
    report.update(files=files, png="not tried yet: the figures come after the numbers", figure_errors=[])
    write_json(report, out)
    errors = report["figure_errors"]
    try:
        figs = figures(report)
    except Exception as err:  # a boundary: the numbers are saved; a figure that fails is reported, not fatal
        errors.append(f"the figures could not be drawn: {type(err).__name__}: {err}")
        figs = {}
    for stem, fig in figs.items():
        try:
            fig.write_html(out / f"{stem}.html", include_plotlyjs="cdn")
            files.append(f"{stem}.html")
        except Exception as err:  # the same boundary, per figure
            errors.append(f"{stem}.html could not be written: {type(err).__name__}: {err}")
    report["png"] = write_pngs(figs, out) if figs else "skipped: no figure was drawn"
    if report["png"] == "written":
        files += [f"{stem}.png" for stem in figs]
    write_json(report, out)
    return errors


def write_json(report: dict, out: Path) -> None:
    (out / "bench.json").write_text(json.dumps(plain(report), indent=1))


def write_pngs(figs: dict, out: Path) -> str:
    """PNG copies of the figures through kaleido, which drives a local Chrome or Chromium; says what happened. Without
    a working browser plotly raises RuntimeError (kaleido's ChromeNotFoundError and BrowserFailedError are
    RuntimeErrors too) or, when the browser dies mid-way, an OSError: both are reported, not raised."""
    if importlib.util.find_spec("kaleido") is None:
        return "skipped: kaleido is not installed (pip install -r requirements-dev.txt to get PNG figures)"
    import plotly.io as pio

    try:
        pio.write_images(list(figs.values()), [out / f"{stem}.png" for stem in figs], width=1100, height=550)
    except (RuntimeError, OSError) as err:
        return f"skipped: kaleido could not draw them, most often for want of a working Chrome or Chromium " \
               f"({type(err).__name__}: {err})"
    return "written"


def fmt(s: Spread | None, places: int = 1) -> str:
    """A spread as 'median [min-max]'."""
    return "-" if not s else f"{s.median:.{places}f} [{s.min:.{places}f}-{s.max:.{places}f}]"


def ratio(s: Spread | None) -> str:
    return "-" if not s else f"{s.median:.2f}x"


def ratios(s: Spread | None) -> str:
    """A spread of speedups as 'median x [min-max]'."""
    return "-" if not s else f"{s.median:.2f}x [{s.min:.2f}-{s.max:.2f}]"


def per_step(s: Spread | None, runs: int) -> str:
    """A window's median tokens per step, with how many runs reached it when not all did."""
    return "-" if not s else f"{s.median:.2f}" + (f" ({s.n})" if s.n < runs else "")


def long_output_table(section) -> tuple[list[str], list[list[str]]]:
    """The long-output table as a header and rows of cells: per method, median tokens per step in each window of
    output positions, output length, decode tokens/s, and decode speedup over the target alone."""
    labels = list(dict.fromkeys(k for r in section.rows for k in r.windows))
    header = ["method", *labels, "new tokens", "decode tok/s", "x AR (decode)"]
    rows = [[r.method, *(per_step(r.windows.get(k), r.new_tokens.n) for k in labels),
             f"{r.new_tokens.median:.0f} [{r.new_tokens.min:.0f}-{r.new_tokens.max:.0f}]", fmt(r.decode_tokens_per_s),
             ratios(r.decode_speedup_vs_autoregressive)] for r in section.rows]
    return header, rows


def by_source(split: dict | None) -> str:
    """Tokens per step by who proposed them, as 'draft / lookup / both / target'."""
    return "-" if not split else " / ".join(f"{v:.2f}" for v in split.values())


def markdown(report: dict) -> str:
    """The report as Markdown tables: the grid per input length, the goals, the needle and sweep sections."""
    lines = []
    for length in sorted({r.length for r in report["cells"]}):
        mine = [r for r in report["cells"] if r.length == length]
        lines += [f"**~{length} input tokens** (median [min-max] over {mine[0].decode_tokens_per_s.n} runs; "
                  f"phase seconds are medians)", "",
                  "| method | decode tok/s | e2e tok/s | x AR | x speculative | x hf_assisted | x hf_prompt_lookup | "
                  "mean accepted | per step: draft / lookup / both / target | "
                  + " | ".join(f"{p} s" for p in PHASES) + " | CMR share |",
                  "|---" * (10 + len(PHASES)) + "|"]
        for r in mine:
            name = r.method + (f" (= {r.same_as})" if r.same_as else "")
            phases = [f"{r.phase_seconds[p]:.2f}" if r.phase_seconds else "-" for p in PHASES]
            share = r.cmr_overhead_share
            speedups = " | ".join(ratio(r.speedup("decode", base)) for base in BASELINES)
            lines.append(f"| {name} | {fmt(r.decode_tokens_per_s)} | {fmt(r.e2e_tokens_per_s)} | {speedups} | "
                         f"{fmt(r.mean_accepted, 2)} | {by_source(r.tokens_per_step_by_source)} | "
                         + " | ".join(phases) + f" | {'-' if not share else format(share.median, '.1%')} |")
        lines.append("")
    if report["goals"]:
        lines += ["| goal | target | measured | met |", "|---|---|---|---|"]
    for g in report["goals"]:
        target = f"<= {g.target:.0%}" if "overhead" in g.goal else f">= {g.target}"
        value = "-" if g.value is None else (f"{g.value:.1%}" if "overhead" in g.goal else f"{g.value:.2f}")
        lines.append(f"| {g.goal} | {target} | {value} | {'yes' if g.met else 'no'} |")
    if report.get("needle"):
        needle = report["needle"]
        summary = needle.summary
        depths = list(summary.by_depth)
        names = summary.signals
        lines += ["", f"**Needle retrieval**: {summary.needles} needles in ~{needle.haystack_tokens}-token "
                  "haystacks from " + ", ".join(needle.documents) + ". Hold: the whole needle in the working "
                  "cache after the first retrieval; answer: the draft alone's answer holds the planted value", "",
                  "| | all | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---" * (2 + len(depths)) + "|"]
        for key, verb in (("hold_rate", "hold"), ("accuracy", "answer")):
            for reader, value in getattr(summary, key).items():
                label = {"target": "the target (ceiling)", "full": "full cache", "streaming": "StreamingLLM"}.get(
                    reader, f"CMR, {reader} signal" + (f" ({names[reader]})" if names.get(reader, reader) != reader else ""))
                lines.append(f"| {verb}: {label} | {value:.0%} | "
                             + " | ".join(f"{getattr(summary.by_depth[d], key)[reader]:.0%}" for d in depths) + " |")
    if report.get("long_output"):
        section = report["long_output"]
        header, rows = long_output_table(section)
        lines += ["", f"**Long outputs**: up to {section.max_new_tokens} new tokens from {len(section.prompts)} short "
                  f"prompts ({', '.join(section.prompts)}). Tokens per step in each window of {section.window} output "
                  "positions (median over runs; (n): the runs that reached it, when not all did); new tokens, decode "
                  "tokens/s and the decode speedup over the target alone on the same prompt: median [min-max]", "",
                  "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    if report.get("sweep"):
        lines += ["", f"**Retrieval settings**: specextend on {report['sweep_input']}", "",
                  "| setting | decode tok/s | e2e tok/s | mean accepted | CMR share | retrievals |", "|---|---|---|---|---|---|"]
        for s in report["sweep"]:
            lines.append(f"| {s.setting} | {fmt(s.decode_tokens_per_s)} | {fmt(s.e2e_tokens_per_s)} | "
                         f"{fmt(s.mean_accepted, 2)} | {s.cmr_overhead_share.median:.1%} | {s.retrievals.median:.0f} |")
    return "\n".join(lines) + "\n"


def table(report: dict) -> str:
    """The console's table: the grid (when it ran), one line per needle and sweep row, the long-output table, the
    goals."""
    lines = [f"{'tokens':>6} {'method':<31} {'decode tok/s':>20} {'e2e tok/s':>18} {'xAR':>6} {'xspec':>6} "
             f"{'xHF':>6} {'xHFPL':>6} {'accepted':>17} {'CMR share':>9}"] if report["cells"] else []
    for r in report["cells"]:
        share = r.cmr_overhead_share
        name = r.method + (f" (={r.same_as})" if r.same_as else "")
        speedups = " ".join(f"{ratio(r.speedup('decode', base)):>6}" for base in BASELINES)
        lines.append(f"{r.prompt_tokens:>6.0f} {name:<31} {fmt(r.decode_tokens_per_s):>20} "
                     f"{fmt(r.e2e_tokens_per_s):>18} {speedups} {fmt(r.mean_accepted, 2):>17} "
                     f"{'-' if not share else format(share.median, '.1%'):>9}")
    if report.get("needle"):
        summary = report["needle"].summary
        lines.append(f"needle ({summary.needles} needles, ~{report['needle'].haystack_tokens} tokens): hold "
                     + ", ".join(f"{k} {v:.0%}" for k, v in summary.hold_rate.items()) + "; answers "
                     + ", ".join(f"{k} {v:.0%}" for k, v in summary.accuracy.items()))
    for s in report.get("sweep") or []:
        lines.append(f"sweep {s.setting:<44} decode {fmt(s.decode_tokens_per_s)} tok/s, "
                     f"accepted {fmt(s.mean_accepted, 2)}, CMR share {s.cmr_overhead_share.median:.1%}")
    if report.get("long_output"):
        section = report["long_output"]
        header, rows = long_output_table(section)
        widths = [max(len(x) for x in column) for column in zip(header, *rows)]
        lines.append(f"long output: tokens per step by window of {section.window} new tokens, "
                     f"{len(section.prompts)} prompts")
        lines += [" ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
                  for row in [header, *rows]]
    for g in report["goals"]:
        value = "-" if g.value is None else f"{g.value:.3g}"
        lines.append(f"goal: {g.goal}: {value} (target {g.target}) {'met' if g.met else 'MISSED'}")
    return "\n".join(lines)
