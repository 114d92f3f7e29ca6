# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack report`: schema errors, the report of a small synthetic results
folder, and `--check` on a stale README section or report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_stack import cli, report
from hybrid_stack.bench import common

ROOT = Path(__file__).resolve().parents[1]
README = f"# demo\n\n## Results\n\n{report.BEGIN}\n{report.END}\n\n## Measurements\n\ntext\n"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(bench: str, rows: list[dict], gpu: str = "h200", **extra) -> dict:
    return {
        "bench": bench,
        "gpu": gpu,
        "torch": "2.11.0",
        "triton": "3.6.0",
        "vllm_base": "0.33.0",
        "command": f"python run.py --bench {bench}",
        "rows": rows,
        "gpu_name": "NVIDIA H200",
        **extra,
    }


def row(case: dict, metric: str, baseline, value, ms: float = 1.0, **extra) -> dict:
    r = value / baseline if baseline and value is not None else None
    return {"case": case, "metric": metric, "baseline": baseline, "value": value, "ratio": r}


def timed(case: dict, metric: str, baseline: float, value: float, **extra) -> dict:
    return {**row(case, metric, baseline, value), "baseline_ms": 2.0, "value_ms": 1.0, **extra}


def synthetic() -> dict[str, dict]:
    """file name -> result: one of each benchmark the report knows, and one it does not."""
    ssd = [
        timed(
            {"dims": "d1", "tokens": t, "seqs": s}, "tok_per_s", 1e6 * t / 1024, v * 1e6 * t / 1024
        )
        for s in (1, 8)
        for t, v in ((1024, 5.0), (16384, 2.5), (262144, 3.0))
    ]
    hit = []
    for budget in (16.0, 3.0):
        for wl, align, all_ in (("system_prompts", 0.8, 1.0), ("shared_doc", 0.9, None)):
            x = row(
                {"workload": wl, "model": "m", "mode": "all", "block_size": 576},
                "cached_over_ideal",
                align,
                all_ if budget == 3.0 else 1.0,
            )
            x["case"]["kv_budget_gib"] = budget
            x["per_mode"] = {
                "none": {"cached_over_ideal": 0.0},
                "align": {"cached_over_ideal": align},
                "all": {"cached_over_ideal": x["value"]},
            }
            hit.append(x)
    return {
        "state_copy-h200.json": result(
            "state_copy",
            [
                timed({"requests": q}, "pct_of_d2d", p, p, value_gbps=p * 40)
                for q, p in ((1, 70.26), (8, 89.5), (128, 92.94))
            ],
            d2d_gbps=4000.0,
        ),
        "ssd_prefill-h200.json": result("ssd_prefill", ssd, stack_kernel="k.fused"),
        "gdn_prefill-h200.json": result(
            "gdn_prefill",
            [timed({"tokens": 8192, "seqs": 1}, "tok_per_s", 11.5e6, 11.5e6)],
            notes={"value": "no stack kernel"},
        ),
        "gdn_checkpoint-h200.json": result(
            "gdn_checkpoint",
            [timed({"tokens": 8192, "seqs": 1, "block_size": 576}, "tok_per_s", 11.5e6, 10.35e6)],
        ),
        "hitrate.json": result("hitrate", hit, gpu="cpu"),
        "e2e-h200.json": result(
            "e2e",
            [
                timed({"model": "mm", "tokens": 16384, "seqs": 1}, "prefill_tok_per_s", 8e4, 9.6e4),
                timed(
                    {"model": "mm", "mode": "none", "mtp_k": 0, "scenario": "x"}, "identical", 1, 1
                ),
                timed(
                    {"model": "q", "mode": "align", "mtp_k": 0, "prefix_tokens": 8192},
                    "ttft_ms",
                    200,
                    50,
                    cached_tokens=8064,
                    ideal_cached_tokens=8064,
                ),
            ],
            notes=["a note"],
        ),
        "e2e-allmode-h200.json": result(
            "e2e-allmode",
            [
                timed(
                    {"model": "q", "mode": mode, "mtp_k": 3, "scenario": sc},
                    "identical",
                    1,
                    same,
                    cached_tokens=cached,
                    ideal_cached_tokens=ideal,
                )
                for mode, sc, same, cached, ideal in (
                    ("align", "cold", 0, 0, 0),
                    ("align", "shared-prefix", 0, 0, 544),
                    ("all", "cold", 1, 0, 0),
                    ("all", "shared-prefix", 1, 576, 576),
                    ("all", "shared-prefix-vs-cold", 1, 576, 576),
                )
            ]
            + [
                timed(
                    {"model": "q", "mode": mode, "mtp_k": 3, "prefix_tokens": 32768},
                    "ttft_ms",
                    1000,
                    warm,
                    cached_tokens=32256,
                    ideal_cached_tokens=32256,
                    block_size=576,
                )
                for mode, warm in (("align", 30), ("all", 50))
            ]
            + [
                timed(
                    {"model": "q", "mtp_k": 3, "decode_tokens": 256},
                    "decode_tok_per_s",
                    100,
                    99,
                    baseline_gpu_ms=50.0,
                    value_gpu_ms=50.0,
                    gpu_ratio=1.0,
                )
            ],
        ),
        "other-h200.json": result("other", [timed({"n": 1}, "x", 1.0, 2.0)]),
    }


def make_root(tmp_path: Path, files: dict[str, dict] | None = None) -> Path:
    (tmp_path / "results").mkdir()
    for name, data in (synthetic() if files is None else files).items():
        (tmp_path / "results" / name).write_text(json.dumps(data))
    (tmp_path / "README.md").write_text(README)
    return tmp_path


def run(root: Path, *args: str) -> int:
    return cli.main(["--root", str(root), "report", *args])


# ------------------------------------------------------------------ schema


@pytest.mark.parametrize(
    ("break_it", "field"),
    [
        (lambda d: d.pop("command"), "field 'command': missing"),
        (lambda d: d.update(torch=2.11), "field 'torch': expected str, got float"),
        (lambda d: d.update(extra_fact=1), "field 'extra_fact': not in the schema"),
        (lambda d: d.update(rows=[]), "field 'rows': empty"),
        (lambda d: d["rows"][1].pop("value_ms"), "field 'rows[1].value_ms': missing"),
        (lambda d: d["rows"][0].update(value="fast"), "field 'rows[0].value': expected"),
        (lambda d: d["rows"][0].update(case=[1]), "field 'rows[0].case': expected dict"),
        (lambda d: d["rows"][0].update(ratio=True), "field 'rows[0].ratio': expected"),
        (lambda d: d.update(gpu="a100"), "field 'bench' / 'gpu': the file of this result"),
    ],
)
def test_schema_error_names_file_and_field(tmp_path: Path, capsys, break_it, field):
    files = synthetic()
    break_it(files["state_copy-h200.json"])
    root = make_root(tmp_path, files)
    assert run(root, "--check") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("hybrid-stack report: error: results/state_copy-h200.json: " + field)


def test_schema_optional_keys_and_nulls():
    data = synthetic()["hitrate.json"]  # CPU rows: no *_ms; a None value (no fit)
    assert common.validate(data) == []
    assert common.validate(dict(data, triton=None, stack_kernel=None)) == []
    assert common.validate(dict(data, notes={"a": "b"})) == []
    assert common.validate(dict(data, notes="text")) == [
        "field 'notes': expected dict or list, got str"
    ]
    assert common.validate([data]) == ["top level: expected an object, got list"]


def test_unreadable_json_is_one_line(tmp_path: Path, capsys):
    root = make_root(tmp_path)
    (root / "results" / "broken.json").write_text("{")
    assert run(root, "--check") == 2
    assert "results/broken.json: not readable JSON" in capsys.readouterr().err


def test_committed_results_validate_and_the_report_is_current(capsys):
    assert {r.bench for r in report.load_results(ROOT)} >= {"ssd_prefill", "hitrate", "e2e"}
    assert run(ROOT, "--check") == 0, capsys.readouterr().out


# ------------------------------------------------------------------ report


def test_report_of_a_synthetic_results_folder(tmp_path: Path):
    root = make_root(tmp_path)
    assert run(root) == 0
    out = root / "results" / "report"
    assert sorted(p.name for p in out.glob("*.png")) == [
        "gdn_prefill-h200.png",
        "hitrate.png",
        "ssd_prefill-h200.png",
        "state_copy-h200.png",
    ]
    for png in out.glob("*.png"):
        assert png.read_bytes().startswith(PNG_MAGIC)
    md = (out / "report.md").read_text()
    assert "| 1 | 2810 | 70.3 | 1.000 |" in md  # state copy: GB/s, % of D2D, ms
    assert "| d1 | 16384 | 8 | - | 16.00M | 40.00M | 2.50x |" in md  # ssd_prefill
    assert "| m | 576 | 3 | shared_doc | 0.000 | 0.900 | - |" in md  # hitrate, no fit
    assert "| mm | 16384 | 1 | 80000 | 96000 | 1.20x |" in md  # e2e prefill
    assert "| q | align | 0 | 8192 | 200 | 50 | 0.250 | 8064 / 8064 |" in md  # e2e TTFT
    assert "| 8192 | 1 | 576 | - | 11.50M | 10.35M | 0.900x |" in md  # gdn_checkpoint
    assert "| q | 3 | 100 | 99 | 0.99x | 1.00x |" in md  # all-mode decode, GPU time beside
    assert "| 1 | x | 1 | 2 | 2 | 2 | 1 |" in md  # the generic table of "other"
    assert md.count("![") == 4 and md.count("<!-- plot sha256 ") == 4
    readme = (root / "README.md").read_text()
    assert readme.startswith("# demo\n\n## Results\n\n" + report.BEGIN)
    assert readme.endswith(report.END + "\n\n## Measurements\n\ntext\n")
    for headline in (
        "| Mamba state copy (NVIDIA H200) | 70.3% of D2D at 1 request, 92.9% at 128 |",
        "fused 2.50-3.00x the chain from 16k tokens, 5.00x at 1k (Triton 3.6.0) |",
        "cached/ideal at 16 GiB: all 1.000, align 0.800-0.900; at 3 GiB all 1.000 |",
        "with checkpoints 0.900x of the prefill without",
        "whole-model prefill fused / chain 1.20x at 16k (mm); "
        "TTFT warm / cold 0.25 at 8k (q align, MTP k 0)",
        "q (MTP k 3): prefix tokens cached for prompts sharing a prefix align 0/544, "
        "all 576/576; greedy tokens equal to caching off align 0/2, all 2/2, "
        "to the mode's own cold run all 1/1; "
        "MTP k 3: TTFT warm / cold at 32k align 0.03, all 0.05, decode all / align 0.99x",
        "[state_copy](results/state_copy-h200.md)",
        "[results/report/report.md](results/report/report.md)",
    ):
        assert headline in readme, headline
    # known benchmarks in their order, the unknown one last
    assert readme.index("Mamba state copy") < readme.index("SSD prefill") < readme.index("| other")


def test_plot_specs_say_what_the_issue_asks():
    secs = dict(
        (r.bench, s)
        for r, s in report.sections(
            [report.Result(Path("results") / k, v) for k, v in synthetic().items()]
        )
    )
    (ssd,) = secs["ssd_prefill"].plots
    assert [p["title"] for p in ssd["panels"]] == ["1 sequence per call", "8 sequences per call"]
    assert all(p["logx"] and "log scale" in p["xlabel"] for p in ssd["panels"])
    labels = [s["label"] for s in ssd["panels"][0]["series"]]
    assert labels == ["d1 fused", "d1 chain"]
    assert ssd["panels"][0]["series"][1]["y"] == [1.0, 16.0, 256.0]  # chain, M tok/s
    (gdn,) = secs["gdn_prefill"].plots
    assert [s["label"] for s in gdn["panels"][0]["series"]] == [
        "without checkpoints (gdn_prefill)",
        "with checkpoints, block 576 (gdn_checkpoint)",
    ]
    assert gdn["panels"][0]["series"][1]["y"] == [10.35]
    (hit,) = secs["hitrate"].plots
    assert [p["title"] for p in hit["panels"]] == [
        "m, block 576 tokens, KV budget 16 GiB",
        "m, block 576 tokens, KV budget 3 GiB",
    ]
    assert [s["y"] for s in hit["panels"][1]["series"]] == [[0.0, 0.0], [0.8, 0.9], [1.0, None]]
    (copy,) = secs["state_copy"].plots
    assert copy["panels"][0]["series"][0]["y"] == [70.26, 89.5, 92.94]
    for spec in (ssd, gdn, hit, copy):
        assert spec["title"] and all(p["xlabel"] and p["ylabel"] for p in spec["panels"])


def test_gdn_checkpoint_state_dtype_is_a_column_and_a_series():
    data = synthetic()
    ckpt = data["gdn_checkpoint-h200.json"]
    (fp32,) = ckpt["rows"]
    bf16 = json.loads(json.dumps(fp32))
    fp32["case"]["state_dtype"] = "fp32"
    bf16["case"]["state_dtype"] = "bf16"
    bf16["value"] = 11.0e6
    bf16["ratio"] = bf16["value"] / bf16["baseline"]
    ckpt["rows"].append(bf16)
    secs = dict(
        (r.bench, s)
        for r, s in report.sections(
            [report.Result(Path("results") / k, v) for k, v in data.items()]
        )
    )
    md = "\n".join(secs["gdn_checkpoint"].lines)
    assert "| tokens | seqs | block size | state | checkpoints |" in md
    assert "| 8192 | 1 | 576 | fp32 | - | 11.50M | 10.35M | 0.900x |" in md
    assert "| 8192 | 1 | 576 | bf16 | - |" in md
    assert secs["gdn_checkpoint"].headline == (
        "with checkpoints (fp32 state 0.900x, bf16 state 0.957x) of the prefill"
        " without (plotted with gdn_prefill)"
    )
    (gdn,) = secs["gdn_prefill"].plots
    assert [(s["label"], s["y"]) for s in gdn["panels"][0]["series"][1:]] == [
        ("with checkpoints, block 576 (gdn_checkpoint)", [10.35]),
        ("with checkpoints, block 576, bf16 state (gdn_checkpoint)", [11.0]),
    ]


def test_ssd_prefill_keeps_an_earlier_tritons_ratio_as_a_column():
    data = synthetic()["ssd_prefill-h200.json"]
    data["rows"][0]["ratio_triton_3_6"] = 4.5  # kept from the Triton 3.6 table
    (sec,) = [s for _, s in report.sections([report.Result(Path("results/x"), data)])]
    assert sec.lines[0].endswith("| fused / chain | fused / chain, Triton 3.6 |")
    assert "| d1 | 1024 | 1 | - | 1.00M | 5.00M | 5.00x | 4.50x |" in sec.lines
    assert "| d1 | 16384 | 1 | - | 16.00M | 40.00M | 2.50x | - |" in sec.lines
    assert sec.headline.endswith("5.00x at 1k (Triton 3.6.0)")
    # without the field, no column
    plain = synthetic()["ssd_prefill-h200.json"]
    (sec,) = [s for _, s in report.sections([report.Result(Path("results/x"), plain)])]
    assert sec.lines[0].endswith("| fused / chain |")


def test_png_is_deterministic(tmp_path: Path):
    secs = report.sections([report.Result(Path("results/x"), synthetic()["ssd_prefill-h200.json"])])
    spec = secs[0][1].plots[0]
    report.render(spec, tmp_path / "a.png")
    report.render(spec, tmp_path / "b.png")
    png = (tmp_path / "a.png").read_bytes()
    assert png == (tmp_path / "b.png").read_bytes()
    assert b"Software" not in png and b"atplotlib" not in png  # no version in the metadata


def test_drawn_figures_have_titles_labels_legends_and_log_x():
    import matplotlib.pyplot as plt

    results = [report.Result(Path("results") / k, v) for k, v in synthetic().items()]
    for r, s in report.sections(results):
        for spec in s.plots:
            fig = report.draw(spec)
            try:
                assert fig._suptitle.get_text() == spec["title"]
                axes = [ax for ax in fig.axes if ax.get_visible()]
                assert len(axes) == len(spec["panels"])
                for ax, p in zip(axes, spec["panels"]):
                    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
                        p["title"],
                        p["xlabel"],
                        p["ylabel"],
                    )
                    assert ax.get_xscale() == ("log" if p.get("logx") else "linear")
                    assert ax.get_legend() is not None or fig.legends, r.bench
            finally:
                plt.close(fig)


# ------------------------------------------------------------------ --check


def test_check_fails_on_a_stale_readme_section(tmp_path: Path, capsys):
    root = make_root(tmp_path)
    assert run(root, "--check") == 1  # never generated
    assert run(root) == 0
    assert run(root, "--check") == 0
    readme = root / "README.md"
    before = readme.read_text()
    readme.write_text(before.replace("92.9% at 128", "93.0% at 128"))
    capsys.readouterr()
    assert run(root, "--check") == 1
    out = capsys.readouterr().out
    assert "stale: README.md (results section)" in out and "report.md" not in out
    assert readme.read_text() != before  # --check writes nothing
    assert run(root) == 0
    assert readme.read_text() == before
    assert run(root, "--check") == 0


def test_check_fails_on_a_stale_report(tmp_path: Path, capsys):
    root = make_root(tmp_path)
    assert run(root) == 0
    out = root / "results" / "report"
    md = out / "report.md"
    md.write_text(md.read_text().replace("2.50x", "2.60x"))
    capsys.readouterr()
    assert run(root, "--check") == 1
    assert "stale: results/report/report.md:" in capsys.readouterr().out
    assert run(root) == 0 and run(root, "--check") == 0

    (out / "ssd_prefill-h200.png").unlink()
    (out / "old.png").write_bytes(PNG_MAGIC)
    capsys.readouterr()
    assert run(root, "--check") == 1
    text = capsys.readouterr().out
    assert "results/report/ssd_prefill-h200.png (missing)" in text
    assert "results/report/old.png (not generated)" in text
    assert run(root) == 0 and run(root, "--check") == 0
    assert not (out / "old.png").exists()


def test_check_fails_when_the_results_change(tmp_path: Path, capsys):
    root = make_root(tmp_path)
    assert run(root) == 0
    path = root / "results" / "state_copy-h200.json"
    data = json.loads(path.read_text())
    data["rows"][0]["value"] = 71.0  # plotted and in the headline
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert run(root, "--check") == 1
    out = capsys.readouterr().out
    assert "README.md (results section)" in out and "results/report/report.md" in out


def test_check_sees_a_plot_only_change(tmp_path: Path, capsys):
    """A plotted value that no table or headline shows still makes report.md stale
    (through the plot's sha256)."""
    root = make_root(tmp_path)
    assert run(root) == 0
    path = root / "results" / "ssd_prefill-h200.json"
    data = json.loads(path.read_text())
    data["rows"][0]["value"] *= 1.0001  # below the tables' precision
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert run(root, "--check") == 1
    assert "results/report/report.md" in capsys.readouterr().out


def test_readme_without_markers_is_one_line_error(tmp_path: Path, capsys):
    root = make_root(tmp_path)
    (root / "README.md").write_text("# no markers\n")
    assert run(root, "--check") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and report.BEGIN in err


def test_e2e_rows_name_a_drafter_other_than_mtp(tmp_path: Path):
    """Identity rows drafted by n-gram lookup are told apart from MTP rows of
    the same k, in the headline and in the identity table."""
    files = synthetic()
    rows = files["e2e-allmode-h200.json"]["rows"]
    ngram = json.loads(json.dumps(rows[2]))  # all mode, cold, MTP k 3
    ngram["case"]["drafter"] = "ngram"
    ngram["value"] = 0
    rows.append(ngram)
    root = make_root(tmp_path, files)
    assert run(root) == 0
    readme = (root / "README.md").read_text()
    assert "q (MTP k 3, 3 (ngram)): prefix tokens cached" in readme
    md = (root / "results/report/report.md").read_text()
    assert "| q | all | 3 (ngram) | cold | no | - |" in md
    assert common.draft_k({"mtp_k": 0, "drafter": "ngram"}) == "0"
