"""Figures of a benchmark report (specextend.tools.bench): throughput by input length, speedup over standard
speculative decoding, acceptance and phases at the longest input, needles by depth, the retrieval sweep, tokens per
step along a long output. Plotly Figures from the report's rows (its grid cells, sweep and long-output rows, read by
attribute); no gradio."""

from __future__ import annotations

from specextend.metrics import PHASES


def grid_figures(rows: list[dict]) -> dict:
    """The grid's figures: throughput by length, speedup over speculative, acceptance and phases at the longest."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    names = list(dict.fromkeys(r.method for r in rows))
    figs = {}
    fig = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s", "end-to-end tokens/s"))
    palette = qualitative.D3
    for i, name in enumerate(names):
        mine = [r for r in rows if r.method == name]
        for col, field in ((1, "decode_tokens_per_s"), (2, "e2e_tokens_per_s")):
            med = [getattr(r, field).median for r in mine]
            fig.add_trace(go.Scatter(
                x=[r.length for r in mine], y=med, name=name, legendgroup=name, showlegend=col == 1,
                line=dict(color=palette[i % len(palette)]),
                error_y=dict(type="data", symmetric=False, array=[getattr(r, field).max - m for r, m in zip(mine, med)],
                             arrayminus=[m - getattr(r, field).min for r, m in zip(mine, med)])), row=1, col=col)
    fig.update_xaxes(title_text="input tokens", type="log")
    figs["throughput"] = fig.update_layout(title="Throughput by input length (median, min-max)")
    fig = go.Figure()
    for name in names:
        mine = [r for r in rows if r.method == name and r.speedup("decode", "speculative")]
        fig.add_bar(x=[str(r.length) for r in mine], y=[r.speedup("decode", "speculative").median for r in mine],
                    name=name)
    figs["speedup"] = fig.update_layout(title="Decode speedup over standard speculative decoding", barmode="group",
                                        xaxis_title="input tokens", yaxis_title="x speculative")
    longest = max((r.length for r in rows), default=0)
    at_longest = [r for r in rows if r.length == longest]
    fig = go.Figure()
    for r in at_longest:
        if r.acceptance_by_position:
            fig.add_scatter(x=list(range(1, len(r.acceptance_by_position) + 1)), y=r.acceptance_by_position,
                            name=r.method)
    figs["acceptance"] = fig.update_layout(title=f"Acceptance by draft position at {longest} tokens",
                                           xaxis_title="draft position", yaxis_title="P(accepted)")
    fig = go.Figure()
    for phase in PHASES:
        timed = [r for r in at_longest if r.phase_seconds]
        fig.add_bar(x=[r.method for r in timed], y=[r.phase_seconds[phase] for r in timed], name=phase)
    figs["phases"] = fig.update_layout(title=f"Time per phase at {longest} tokens (median s)", barmode="stack")
    return figs


def figures(report: dict) -> dict:
    """Plotly figures of the report, by file stem."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [r for r in report["cells"] if not r.same_as]
    figs = grid_figures(rows) if rows else {}  # a needle-only run has no grid
    if report.get("needle"):
        by_depth = report["needle"].summary.by_depth
        fig = make_subplots(rows=1, cols=2, subplot_titles=("whole needle in the working cache after the first retrieval",
                                                            "answers holding the value (the draft alone; the target)"))
        for col, key in ((1, "hold_rate"), (2, "accuracy")):
            for reader in getattr(next(iter(by_depth.values())), key):
                fig.add_bar(x=list(by_depth), y=[getattr(by_depth[d], key)[reader] for d in by_depth], name=f"{reader}",
                            legendgroup=reader, showlegend=col == 1 or reader in ("target", "full"), row=1, col=col)
        figs["needle"] = fig.update_layout(title="Needles by depth, per retrieval signal and cache", barmode="group")
    if report.get("sweep"):
        sweep = report["sweep"]
        fig = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s", "mean accepted length"))
        fig.add_bar(x=[s.setting for s in sweep], y=[s.decode_tokens_per_s.median for s in sweep], row=1, col=1)
        fig.add_bar(x=[s.setting for s in sweep], y=[s.mean_accepted.median for s in sweep], row=1, col=2)
        figs["sweep"] = fig.update_layout(title=f"SpecExtend retrieval settings at {report['sweep_input']}",
                                          showlegend=False)
    if report.get("long_output"):
        section = report["long_output"]
        fig = go.Figure()
        for row in section.rows:
            starts = [int(label.split("-")[0]) for label in row.windows]
            fig.add_scatter(x=[s + section.window / 2 for s in starts], y=[w.median for w in row.windows.values()],
                            name=row.method, mode="lines+markers")
        figs["long_output"] = fig.update_layout(
            title=f"Tokens per step along a long output (median over runs on {len(section.prompts)} prompts, "
                  f"windows of {section.window})", xaxis_title="output position (window centre)",
            yaxis_title="tokens per step")
    return figs
