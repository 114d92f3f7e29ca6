# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack report`: tables and plots of the committed results.

Reads every ``results/*.json`` (one benchmark each), validates it against the
one results schema (``hybrid_stack.bench.common.SCHEMA``), and writes
``results/report/report.md`` (tables, links to the plots) with one PNG per
plotted benchmark beside it, and the README's results section between
``<!-- hybrid-stack report -->`` and ``<!-- /hybrid-stack report -->``.

Each plot is first a plain-data spec (titles, axes, series); ``render``
draws a spec with matplotlib (Agg). report.md carries, under each plot, the
sha256 of its spec and of ``draw``'s and ``render``'s source, so ``--check`` compares text
only: the README section, report.md and the list of PNG files. That holds on
any machine, whatever its matplotlib and fonts draw; the PNG bytes are not
compared.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybrid_stack.bench import common
from hybrid_stack.errors import StackError
from hybrid_stack.stack import find_root

BEGIN = "<!-- hybrid-stack report -->"
END = "<!-- /hybrid-stack report -->"
REPORT_DIR = Path("results") / "report"
REPORT_MD = "report.md"


# ---------------------------------------------------------------- loading


@dataclass
class Result:
    path: Path  # relative to the root, e.g. results/ssd_prefill-h200.json
    data: dict[str, Any]

    @property
    def bench(self) -> str:
        return self.data["bench"]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.data["rows"]

    @property
    def md_link(self) -> str:
        return self.path.with_suffix(".md").as_posix()

    @property
    def gpu_label(self) -> str:
        return "CPU" if self.data["gpu"] == "cpu" else self.data.get("gpu_name", self.data["gpu"])


def load_results(root: Path) -> list[Result]:
    """Every results/*.json, validated; the first problem is a one-line error."""
    out = []
    for path in sorted((root / "results").glob("*.json")):
        rel = path.relative_to(root)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise StackError(f"{rel}: not readable JSON ({e}): fix or regenerate it") from e
        problems = common.validate(data)
        if not problems:
            stem = data["bench"] if data["gpu"] == "cpu" else f"{data['bench']}-{data['gpu']}"
            if path.stem != stem:
                problems.append(f"field 'bench' / 'gpu': the file of this result is {stem}.json")
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise StackError(
                f"{rel}: {problems[0]}{more}: fix the file or its benchmark "
                "(schema: hybrid_stack.bench.common.SCHEMA)"
            )
        out.append(Result(rel, data))
    if not out:
        raise StackError(f"no results/*.json under {root}: nothing to report")
    return out


# ---------------------------------------------------------------- formatting


def num(x: Any) -> str:
    """Deterministic short form of a number: 14.33M, 3958, 81.2, 1.25, 0.838."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int) and abs(x) < 1e6:
        return str(x)
    a = abs(x)
    if a >= 1e6:
        return f"{x / 1e6:.2f}M"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if a >= 1 else f"{x:.3f}"


def ratio(x: Any, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}x"


def ratio3(x: Any) -> str:
    """A ratio to three decimals, for goals stated to the percent (0.97)."""
    return ratio(x, 3)


def span(values: Iterable[float], fmt: Callable[[Any], str] = ratio) -> str:
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return "-"
    lo, hi = fmt(vals[0]), fmt(vals[-1])
    return lo if lo == hi else f"{lo.rstrip('x')}-{hi}"


def table(head: list[str], body: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(b) + " |" for b in body),
    ]


def num3(x: Any) -> str:
    """A fraction to three decimals ("-" for null)."""
    return "-" if x is None else f"{x:.3f}"


def tokens_label(t: int) -> str:
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


# ---------------------------------------------------------------- plots


@dataclass
class Section:
    """What one benchmark contributes: a headline, tables, plots."""

    headline: str
    lines: list[str] = field(default_factory=list)
    plots: list[dict[str, Any]] = field(default_factory=list)


def line_panel(title: str, xlabel: str, ylabel: str, series: list[dict], **kw: Any) -> dict:
    return {
        "kind": "line",
        "title": title,
        "xlabel": xlabel,
        "ylabel": ylabel,
        "series": series,
        **kw,
    }


def draw(spec: dict[str, Any]) -> Any:
    """One plot spec as a matplotlib Figure (Agg backend); the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = spec["panels"]
    ncols = spec.get("ncols", len(panels))
    nrows = math.ceil(len(panels) / ncols)
    w, h = spec.get("panel_size", (6.4, 4.4))
    with plt.style.context("default"):
        fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)
        colors = plt.get_cmap("tab10").colors
        for ax, p in zip(axes.flat, panels):
            if p["kind"] == "line":
                for s in p["series"]:
                    ax.plot(
                        s["x"],
                        s["y"],
                        label=s["label"],
                        color=colors[s.get("color", 0) % len(colors)],
                        linestyle="--" if s.get("dashed") else "-",
                        marker=s.get("marker", "o"),
                    )
                if p.get("logx"):
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(p["xticks"], p["xticklabels"])
                    ax.minorticks_off()
            else:  # grouped bars over categories; None = not measured (marked)
                cats, series = p["categories"], p["series"]
                width = 0.8 / len(series)
                for j, s in enumerate(series):
                    xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(cats))]
                    ys = [0 if y is None else y for y in s["y"]]
                    ax.bar(
                        xs,
                        ys,
                        width,
                        label=s["label"],
                        color=colors[s.get("color", j) % len(colors)],
                    )
                    for x, y in zip(xs, s["y"]):
                        if y is None or y == 0:  # no bar to see: say why
                            mark = "no fit" if y is None else "0"
                            ax.text(
                                x, 0.01, mark, rotation=90, ha="center", va="bottom", fontsize=7
                            )
                rot = p.get("rotation", 0)
                ax.set_xticks(range(len(cats)), cats, rotation=rot, ha="right" if rot else "center")
            if "ylim" in p:
                ax.set_ylim(*p["ylim"])
            ax.set_title(p["title"], fontsize=10)
            ax.set_xlabel(p["xlabel"])
            ax.set_ylabel(p["ylabel"])
            ax.grid(True, alpha=0.3)
            if not spec.get("figlegend"):
                ax.legend(fontsize=8, loc=p.get("legend_loc", "best"))
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        inch = 1.0 / fig.get_figheight()  # one inch in figure coordinates
        fig.suptitle(spec["title"], y=1 - 0.1 * inch, va="top")
        top = 1 - 0.45 * inch
        if spec.get("figlegend"):
            handles, labels = axes.flat[0].get_legend_handles_labels()
            fig.legend(
                handles,
                labels,
                loc="upper center",
                ncol=len(labels),
                frameon=False,
                bbox_to_anchor=(0.5, top),
            )
            top -= 0.35 * inch
        fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def render(spec: dict[str, Any], path: Path) -> None:
    """Draw one plot spec into a PNG, with no matplotlib version in its metadata
    (Agg writes no timestamp), so the same spec gives the same bytes."""
    import matplotlib.pyplot as plt

    fig = draw(spec)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def spec_hash(spec: dict[str, Any]) -> str:
    text = json.dumps(spec, sort_keys=True) + inspect.getsource(draw) + inspect.getsource(render)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- benchmarks


def state_copy(r: Result) -> Section:
    rows = sorted(r.rows, key=lambda x: x["case"]["requests"])
    reqs = [x["case"]["requests"] for x in rows]
    pct = [x["value"] for x in rows]
    d2d = r.data.get("d2d_gbps")
    lines = table(
        ["requests", "GB/s", "% of D2D", "ms"],
        [
            [str(x["case"]["requests"]), num(x.get("value_gbps")), f"{x['value']:.1f}"]
            + [f"{x['value_ms']:.3f}"]
            for x in rows
        ],
    )
    spec = {
        "file": f"{r.path.stem}.png",
        "title": f"Mamba state copy on {r.gpu_label}: % of a device-to-device copy",
        "panels": [
            line_panel(
                f"D2D copy {num(d2d)} GB/s" if d2d else "",
                "requests copied per call (log scale)",
                "% of D2D copy bandwidth",
                [{"label": "state copy (upstream kernel)", "x": reqs, "y": pct}],
                logx=True,
                xticks=reqs,
                xticklabels=[str(q) for q in reqs],
                ylim=[0, 100],
                legend_loc="lower right",
            )
        ],
    }
    head = (
        f"{pct[0]:.1f}% of D2D at {reqs[0]} request{'s' if reqs[0] > 1 else ''}, "
        f"{pct[-1]:.1f}% at {reqs[-1]}"
    )
    return Section(head, lines, [spec])


EARLIER_TRITON_RATIO = "ratio_triton_"


def ssd_prefill(r: Result) -> Section:
    rows = sorted(r.rows, key=lambda x: (x["case"]["dims"], x["case"]["seqs"], x["case"]["tokens"]))
    dims = sorted({x["case"]["dims"] for x in rows})
    seqs = sorted({x["case"]["seqs"] for x in rows})
    toks = sorted({x["case"]["tokens"] for x in rows})
    # a table measured under a newer Triton keeps an older table's ratio of the
    # same case as ratio_triton_<major>_<minor> (e.g. ratio_triton_3_6)
    earlier = sorted({k for x in rows for k in x if k.startswith(EARLIER_TRITON_RATIO)})
    lines = table(
        ["dims", "tokens", "seqs", "form", "chain tok/s", "fused tok/s", "fused / chain"]
        + [
            f"fused / chain, Triton {k.removeprefix(EARLIER_TRITON_RATIO).replace('_', '.')}"
            for k in earlier
        ],
        [
            [x["case"]["dims"], str(x["case"]["tokens"]), str(x["case"]["seqs"])]
            + [str(x.get("value_kernel", "-")), num(x["baseline"]), num(x["value"])]
            + [ratio(x["ratio"])]
            + [ratio(x.get(k)) for k in earlier]
            for x in rows
        ],
    )
    panels = []
    for s in seqs:
        series = []
        for i, d in enumerate(dims):
            pts = [x for x in rows if x["case"]["dims"] == d and x["case"]["seqs"] == s]
            t = [x["case"]["tokens"] for x in pts]
            series += [
                {"label": f"{d} fused", "x": t, "y": [x["value"] / 1e6 for x in pts], "color": i},
                {
                    "label": f"{d} chain",
                    "x": t,
                    "y": [x["baseline"] / 1e6 for x in pts],
                    "color": i,
                    "dashed": True,
                    "marker": "s",
                },
            ]
        panels.append(
            line_panel(
                f"{s} sequence{'s' if s > 1 else ''} per call",
                "tokens per call (log scale)",
                "million tokens / s",
                series,
                logx=True,
                xticks=toks,
                xticklabels=[tokens_label(t) for t in toks],
            )
        )
    spec = {
        "file": f"{r.path.stem}.png",
        "title": f"Mamba2 SSD prefill on {r.gpu_label}: fused kernel (solid) vs upstream chain "
        "(dashed)",
        "panels": panels,
    }
    big = [x["ratio"] for x in rows if x["case"]["tokens"] >= 16384]
    small = [x["ratio"] for x in rows if x["case"]["tokens"] == toks[0]]
    head = f"fused {span(big)} the chain from 16k tokens, {span(small)} at {tokens_label(toks[0])}"
    if r.data.get("triton"):  # the kernels are Triton / Gluon: their compiler is part of it
        head += f" (Triton {r.data['triton']})"
    return Section(head, lines, [spec])


def _gdn_case(x: dict[str, Any]) -> str:
    c = x["case"]
    return f"{tokens_label(c['tokens'])} x {c['seqs']}"


def gdn_prefill(r: Result, checkpoints: Result | None = None) -> Section:
    rows = r.rows
    lines = table(
        ["tokens", "seqs", "tok/s", "ms"],
        [
            [str(x["case"]["tokens"]), str(x["case"]["seqs"]), num(x["value"])]
            + [f"{x['value_ms']:.3f}"]
            for x in rows
        ],
    )
    cats = [_gdn_case(x) for x in rows]
    series = [{"label": "without checkpoints (gdn_prefill)", "y": [x["value"] / 1e6 for x in rows]}]
    if checkpoints is not None:
        # one series per block size and state cache dtype (rows without
        # state_dtype predate it: an fp32 cache), fp32 first
        keys = sorted(
            {(x["case"]["block_size"], _state_dtype(x)) for x in checkpoints.rows},
            key=lambda k: (k[0], k[1] != "fp32", k[1]),
        )
        for i, (b, dt) in enumerate(keys):
            by_case = {
                _gdn_case(x): x["value"] / 1e6
                for x in checkpoints.rows
                if (x["case"]["block_size"], _state_dtype(x)) == (b, dt)
            }
            state = "" if dt == "fp32" else f", {dt} state"
            series.append(
                {
                    "label": f"with checkpoints, block {b}{state} ({checkpoints.bench})",
                    "y": [by_case.get(c) for c in cats],
                    "color": i + 1,
                }
            )
    spec = {
        "file": f"{r.path.stem}.png",
        "title": f"GDN chunk prefill on {r.gpu_label}",
        "panels": [
            {
                "kind": "bar",
                "title": "FLA chunk_gated_delta_rule, Qwen3-Next dims, bf16",
                "xlabel": "tokens x sequences per call",
                "ylabel": "million tokens / s",
                "categories": cats,
                "series": series,
                "ylim": [0, 1.3 * max(y for s in series for y in s["y"] if y is not None)],
                "legend_loc": "upper left",
            }
        ],
    }
    head = ", ".join(f"{num(x['value'])} tok/s at {_gdn_case(x)}" for x in rows[:2])
    return Section(head, lines, [spec])


def _state_dtype(row: dict[str, Any]) -> str:
    """A gdn_checkpoint row's state cache dtype (fp32 where the row predates
    the field)."""
    return str(row["case"].get("state_dtype", "fp32"))


def gdn_checkpoint(r: Result) -> Section:
    rows = r.rows
    # the state cache dtype column only where the rows say it
    dtypes = any("state_dtype" in x["case"] for x in rows)
    lines = table(
        ["tokens", "seqs", "block size"]
        + (["state"] if dtypes else [])
        + ["checkpoints", "without tok/s", "with tok/s", "ratio"],
        [
            [str(x["case"]["tokens"]), str(x["case"]["seqs"]), str(x["case"]["block_size"])]
            + ([_state_dtype(x)] if dtypes else [])
            + [str(x["case"].get("checkpoints", "-")), num(x["baseline"]), num(x["value"])]
            + [ratio3(x["ratio"])]
            for x in rows
        ],
    )
    if dtypes:
        # One span per state cache dtype: their costs differ (the bf16 cache
        # converts the state on the way).
        by_dtype: dict[str, list[float]] = {}
        for x in rows:
            by_dtype.setdefault(_state_dtype(x), []).append(x["ratio"])
        spans = ", ".join(f"{d} state {span(v, ratio3)}" for d, v in by_dtype.items())
        head = f"with checkpoints ({spans}) of the prefill without"
    else:
        head = f"with checkpoints {span((x['ratio'] for x in rows), ratio3)} of the prefill without"
    return Section(head + " (plotted with gdn_prefill)", lines)


HITRATE_MODES = ("none", "align", "all")


def hitrate(r: Result) -> Section:
    rows = r.rows
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for x in rows:
        c = x["case"]
        groups.setdefault((c["model"], c["block_size"], c["kv_budget_gib"]), []).append(x)

    def per_mode(x: dict[str, Any], m: str) -> Any:
        return x.get("per_mode", {}).get(m, {}).get("cached_over_ideal")

    body, panels = [], []
    for (model, block, budget), xs in sorted(
        groups.items(), key=lambda g: (g[0][0], g[0][1], -g[0][2])
    ):
        for x in xs:
            body.append(
                [model, str(block), f"{budget:g}", x["case"]["workload"]]
                + [num3(per_mode(x, m)) for m in HITRATE_MODES]
            )
        panels.append(
            {
                "kind": "bar",
                "title": f"{model}, block {block} tokens, KV budget {budget:g} GiB",
                "xlabel": "workload",
                "ylabel": "cached / ideal prefix tokens",
                "categories": [x["case"]["workload"] for x in xs],
                "series": [
                    {"label": f"mode {m}", "y": [per_mode(x, m) for x in xs], "color": i}
                    for i, m in enumerate(HITRATE_MODES)
                ],
                "ylim": [0, 1.05],
                "rotation": 30,
            }
        )
    lines = [
        "cached/ideal per mechanism (`none`: no prefix caching of the GDN state; "
        "`align`, `all`: mamba_cache_mode); `-`: the mode cannot hold one request "
        "in this budget.",
        "",
        *table(["model", "block", "KV GiB", "workload", *HITRATE_MODES], body),
    ]
    budgets = sorted({k[2] for k in groups})
    top = [x for x in rows if x["case"]["kv_budget_gib"] == budgets[-1]]
    low = [x for x in rows if x["case"]["kv_budget_gib"] == budgets[0]]

    head = (
        f"cached/ideal at {budgets[-1]:g} GiB: "
        f"all {span((per_mode(x, 'all') for x in top), num3)}, "
        f"align {span((per_mode(x, 'align') for x in top), num3)}; "
        f"at {budgets[0]:g} GiB all {span((per_mode(x, 'all') for x in low), num3)}"
    )
    spec = {
        "file": f"{r.path.stem}.png",
        "title": "GDN prefix-cache hit rate by workload, mode and KV budget (CPU scheduler "
        "simulation)",
        "panels": panels,
        "ncols": 2,
        "panel_size": [7.0, 4.6],
        "figlegend": True,
    }
    return Section(head, lines, [spec])


def e2e(r: Result) -> Section:
    rows = r.rows
    lines: list[str] = []
    pre = [x for x in rows if x["metric"] == "prefill_tok_per_s"]
    if pre:
        lines += ["Whole-model prefill (higher is better):", ""]
        lines += table(
            ["model", "tokens", "seqs", "chain tok/s", "fused tok/s", "fused / chain"],
            [
                [x["case"]["model"], str(x["case"]["tokens"]), str(x["case"]["seqs"])]
                + [num(x["baseline"]), num(x["value"]), ratio(x["ratio"])]
                for x in pre
            ],
        )
        lines.append("")
    ttft = [x for x in rows if x["metric"] == "ttft_ms"]
    if ttft:
        lines += ["Time to first token on a shared prefix, cold and warm (lower is better):", ""]
        lines += table(
            [
                "model",
                "mode",
                "MTP k",
                "prefix tokens",
                "cold ms",
                "warm ms",
                "warm / cold",
                "cached / ideal",
            ],
            [
                [x["case"]["model"], x["case"]["mode"], common.draft_k(x["case"])]
                + [str(x["case"]["prefix_tokens"]), num(x["baseline"]), num(x["value"])]
                + [f"{x['value'] / x['baseline']:.3f}"]
                + [f"{x.get('cached_tokens', '?')} / {x.get('ideal_cached_tokens', '?')}"]
                for x in ttft
            ],
        )
        lines.append("")
    ident = [x for x in rows if x["metric"] == "identical"]
    if ident:
        lines += ["Greedy tokens identical to the reference:", ""]
        lines += table(
            ["model", "mode", "MTP k", "scenario", "identical", "first divergence"],
            [
                [x["case"]["model"], x["case"]["mode"], common.draft_k(x["case"])]
                + [x["case"]["scenario"], "yes" if x["value"] == 1 else "no"]
                + [str(x["first_divergence"]) if x.get("first_divergence", -1) >= 0 else "-"]
                for x in ident
            ],
        )
        lines.append("")
    parts = []
    if pre:
        per_model = []
        for m in sorted({x["case"]["model"] for x in pre}):
            mine = [x for x in pre if x["case"]["model"] == m]
            sizes = sorted({x["case"]["tokens"] for x in mine})
            at = [
                f"{span(x['ratio'] for x in mine if x['case']['tokens'] == t)} at {tokens_label(t)}"
                for t in sizes
            ]
            per_model.append(f"{', '.join(at)} ({m})")
        parts.append("whole-model prefill fused / chain " + "; ".join(per_model))
    ttft_at: dict[tuple[str, str, int], list[str]] = {}
    for x in ttft:
        c = x["case"]
        ttft_at.setdefault((c["model"], c["mode"], c["mtp_k"]), []).append(
            f"{x['value'] / x['baseline']:.2f} at {tokens_label(c['prefix_tokens'])}"
        )
    for (model, mode, k), at in sorted(ttft_at.items()):
        parts.append(f"TTFT warm / cold {', '.join(at)} ({model} {mode}, MTP k {k})")
    if ident:
        models = sorted({x["case"]["model"] for x in ident})
        counts = [
            f"{m} {sum(x['value'] == 1 for x in ident if x['case']['model'] == m)}"
            f"/{sum(x['case']['model'] == m for x in ident)}"
            for m in models
        ]
        parts.append("greedy tokens identical to the reference: " + ", ".join(counts))
    return Section("; ".join(parts) or f"{len(rows)} rows", lines)


def e2e_allmode(r: Result) -> Section:
    """The all-mode matrix: e2e's tables, plus the timed rows (all against
    align); the headline says what a user of all mode gets: the prefix
    tokens each mode caches where a prompt shares only a prefix, and how
    often the greedy tokens equal prefix caching off's."""
    rows = r.rows
    sec = e2e(r)
    lines = list(sec.lines)
    for metric, title in (
        ("decode_tok_per_s", "Decode throughput of one request, align vs all (higher is better):"),
        ("cold_prefill_tok_per_s", "Prefill of a fresh prompt, align vs all (higher is better):"),
    ):
        mine = [x for x in rows if x["metric"] == metric]
        if mine:
            lines += [title, ""]
            lines += table(
                ["model", "MTP k", "align", "all", "all / align", "GPU time align / all"],
                [
                    [x["case"]["model"], str(x["case"]["mtp_k"])]
                    + [num(x["baseline"]), num(x["value"]), ratio(x["ratio"])]
                    # GPU time beside wall time (rows since it was recorded)
                    + [ratio(x.get("gpu_ratio"))]
                    for x in mine
                ],
            )
            lines.append("")
    ident = [x for x in rows if x["metric"] == "identical"]
    parts = []
    for model in sorted({x["case"]["model"] for x in ident}):
        mine = [x for x in ident if x["case"]["model"] == model]
        ks = sorted({common.draft_k(x["case"]) for x in mine})
        cached, same, own = [], [], []
        for mode in ("align", "all"):
            shared = [
                x
                for x in mine
                if x["case"]["mode"] == mode and x["case"]["scenario"] == "shared-prefix"
            ]
            if shared:
                got = sum(x["cached_tokens"] for x in shared)
                ideal = sum(x["ideal_cached_tokens"] for x in shared)
                cached.append(f"{mode} {got}/{ideal}")
            vs_off = [
                x
                for x in mine
                if x["case"]["mode"] == mode
                and x["case"]["scenario"] in ("cold", "same-twice", "shared-prefix")
            ]
            if vs_off:
                same.append(f"{mode} {sum(x['value'] == 1 for x in vs_off)}/{len(vs_off)}")
            # the rows that judge the cache: a hit against the same engine's cold run
            vs_cold = [
                x
                for x in mine
                if x["case"]["mode"] == mode and x["case"]["scenario"].endswith("-vs-cold")
            ]
            if vs_cold:
                own.append(f"{mode} {sum(x['value'] == 1 for x in vs_cold)}/{len(vs_cold)}")
        parts.append(
            f"{model} (MTP k {', '.join(map(str, ks))}): prefix tokens cached for prompts "
            f"sharing a prefix {', '.join(cached)}; greedy tokens equal to caching off "
            f"{', '.join(same)}" + (f", to the mode's own cold run {', '.join(own)}" if own else "")
        )
    # the timed rows, per MTP k: warm / cold time to first token of each
    # mode, then all against align
    timed = [
        x for x in rows if x["metric"] in ("ttft_ms", "decode_tok_per_s", "cold_prefill_tok_per_s")
    ]
    for k in sorted({x["case"]["mtp_k"] for x in timed}):
        mine = [x for x in timed if x["case"]["mtp_k"] == k]
        got = []
        for n in sorted({x["case"]["prefix_tokens"] for x in mine if x["metric"] == "ttft_ms"}):
            modes = [
                f"{x['case']['mode']} {x['value'] / x['baseline']:.2f}"
                for x in mine
                if x["metric"] == "ttft_ms" and x["case"]["prefix_tokens"] == n
            ]
            got.append(f"TTFT warm / cold at {tokens_label(n)} {', '.join(modes)}")
        for x in mine:
            if x["metric"] != "ttft_ms":
                what = "decode" if x["metric"] == "decode_tok_per_s" else "cold prefill"
                got.append(f"{what} all / align {ratio(x['ratio'])}")
        parts.append(f"MTP k {k}: {', '.join(got)}")
    return Section("; ".join(parts) or f"{len(rows)} rows", lines)


def generic(r: Result) -> Section:
    n = len(r.rows)
    return Section(f"{n} row{'s' if n != 1 else ''}", common.table_lines(r.data, markdown=True))


BENCHES: dict[str, Callable[[Result], Section]] = {
    "state_copy": state_copy,
    "ssd_prefill": ssd_prefill,
    "gdn_checkpoint": gdn_checkpoint,
    "hitrate": hitrate,
    "e2e": e2e,
    "e2e-flashinfer": e2e,
    "e2e-allmode": e2e_allmode,
}
TITLES = {
    "state_copy": "Mamba state copy",
    "ssd_prefill": "Mamba2 SSD prefill",
    "gdn_prefill": "GDN chunk prefill",
    "gdn_checkpoint": "GDN prefill checkpoints",
    "hitrate": "GDN prefix-cache hit rate",
    "e2e": "End to end",
    "e2e-flashinfer": "End to end, vLLM's default Hopper path (FlashInfer GDN prefill and sampler)",
    "e2e-allmode": "End to end, mamba_cache_mode=all",
}


def sections(results: list[Result]) -> list[tuple[Result, Section]]:
    """One section per result, the known benchmarks first in TITLES' order."""
    order = list(TITLES)
    out = []
    for r in sorted(
        results,
        key=lambda r: (order.index(r.bench) if r.bench in order else len(order), r.path.name),
    ):
        if r.bench == "gdn_prefill":
            ckpt = [
                c for c in results if c.bench == "gdn_checkpoint" and c.data["gpu"] == r.data["gpu"]
            ]
            out.append((r, gdn_prefill(r, ckpt[0] if ckpt else None)))
        else:
            out.append((r, BENCHES.get(r.bench, generic)(r)))
    return out


# ---------------------------------------------------------------- documents


def report_md(secs: list[tuple[Result, Section]]) -> str:
    lines = [
        "# Results report",
        "",
        "Generated by `hybrid-stack report` from `results/*.json`; do not edit "
        "(`hybrid-stack report --check` fails when it is stale). Each benchmark's own "
        "markdown file has every column and the notes.",
    ]
    for r, s in secs:
        d = r.data
        lines += [
            "",
            f"## {TITLES.get(r.bench, r.bench)} ({r.bench}, {r.gpu_label})",
            "",
            f"- files: [{r.path.name}](../{r.path.name}), "
            f"[{Path(r.md_link).name}](../{Path(r.md_link).name})",
            f"- command: `{d['command']}`",
            f"- vLLM base {d['vllm_base']}, torch {d['torch']}, triton {d['triton']}"
            + (f", created {d['created']}" if "created" in d else ""),
            f"- headline: {s.headline}",
            "",
        ]
        for spec in s.plots:
            lines += [
                f"![{spec['title']}]({spec['file']})",
                f"<!-- plot sha256 {spec_hash(spec)} -->",
                "",
            ]
        lines += s.lines
    return "\n".join(lines).rstrip() + "\n"


def readme_section(secs: list[tuple[Result, Section]]) -> str:
    body = [
        [f"{TITLES.get(r.bench, r.bench)} ({r.gpu_label})", s.headline, f"[{r.bench}]({r.md_link})"]
        for r, s in secs
    ]
    return "\n".join(
        [
            BEGIN,
            "Generated by `hybrid-stack report` from `results/*.json`; plots and tables: "
            f"[{(REPORT_DIR / REPORT_MD).as_posix()}]({(REPORT_DIR / REPORT_MD).as_posix()}).",
            "",
            *table(["benchmark", "headline", "details"], body),
            END,
        ]
    )


def splice(readme: str, section: str, name: str) -> str:
    if (
        readme.count(BEGIN) != 1
        or readme.count(END) != 1
        or readme.index(BEGIN) > readme.index(END)
    ):
        raise StackError(
            f"{name} needs one '{BEGIN}' line followed by one '{END}' line: add them where "
            "the results section goes"
        )
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + section + readme[end:]


@dataclass
class Outputs:
    readme: str
    report: str
    plots: list[dict[str, Any]]


def generate(root: Path, readme_path: Path) -> Outputs:
    secs = sections(load_results(root))
    if not readme_path.is_file():
        raise StackError(f"{readme_path} not found: pass --readme")
    readme = splice(readme_path.read_text(), readme_section(secs), readme_path.name)
    return Outputs(readme, report_md(secs), [p for _, s in secs for p in s.plots])


def stale(root: Path, readme_path: Path, out: Outputs) -> list[str]:
    """What on disk differs from what `report` would write."""
    found = []
    if readme_path.read_text() != out.readme:
        found.append(f"{readme_path.name} (results section)")
    rdir = root / REPORT_DIR
    md = rdir / REPORT_MD
    if not md.is_file() or md.read_text() != out.report:
        found.append((REPORT_DIR / REPORT_MD).as_posix())
    want = {p["file"] for p in out.plots}
    have = {p.name for p in rdir.glob("*.png")} if rdir.is_dir() else set()
    found += [f"{(REPORT_DIR / f).as_posix()} (missing)" for f in sorted(want - have)]
    found += [f"{(REPORT_DIR / f).as_posix()} (not generated)" for f in sorted(have - want)]
    return found


def write(root: Path, readme_path: Path, out: Outputs) -> None:
    rdir = root / REPORT_DIR
    rdir.mkdir(parents=True, exist_ok=True)
    want = {p["file"] for p in out.plots}
    for old in rdir.glob("*.png"):
        if old.name not in want:
            old.unlink()
    for spec in out.plots:
        print(f"plot {(REPORT_DIR / spec['file']).as_posix()}")
        render(spec, rdir / spec["file"])
    (rdir / REPORT_MD).write_text(out.report)
    print(f"wrote {(REPORT_DIR / REPORT_MD).as_posix()}")
    if readme_path.read_text() != out.readme:
        readme_path.write_text(out.readme)
        print(f"updated the results section of {readme_path.name}")


def run(args: argparse.Namespace) -> int:
    root = (args.root or find_root()).resolve()
    readme_path = args.readme or root / "README.md"
    out = generate(root, readme_path)
    if args.check:
        found = stale(root, readme_path, out)
        if found:
            print(f"hybrid-stack report: stale: {', '.join(found)}: run hybrid-stack report")
            return 1
        print(f"report up to date ({len(out.plots)} plots)")
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise StackError(
            "matplotlib is not installed: pip install -e '.[report]' (or '.[test]')"
        ) from e
    write(root, readme_path, out)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="validate results/*.json, write tables, plots, README section"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming what is stale (README section, results/report/)",
    )
    p.add_argument("--readme", type=Path, default=None, help="README to update (default: root's)")
    p.set_defaults(func=run)
