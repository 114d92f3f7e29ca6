# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack status`: a table of the series."""

from __future__ import annotations

import argparse

from hybrid_stack.applier import ApplyConflict, trial_apply
from hybrid_stack.stack import Entry, Stack, load_stack


def diff_counts(stack: Stack, e: Entry) -> tuple[int, int, int]:
    """(files, added lines, removed lines) of an entry's patch + overlay files."""
    files, add, rem = set(), 0, 0
    if e.patch and (stack.patches_dir / e.patch).is_file():
        for line in (stack.patches_dir / e.patch).read_text(errors="replace").splitlines():
            if line.startswith("diff --git "):
                files.add(line.split(" b/", 1)[-1])
            elif line.startswith("+") and not line.startswith("+++"):
                add += 1
            elif line.startswith("-") and not line.startswith("---"):
                rem += 1
    for p in e.overlay:
        files.add(p)
        f = stack.overlay_dir / p
        if f.is_file():
            add += len(f.read_bytes().splitlines())
    return len(files), add, rem


def applies(stack: Stack, source: str) -> dict[str, str]:
    """Entry name -> 'yes' / 'CONFLICT' / 'not reached' from a throwaway apply."""
    result = {e.name: "yes" for e in stack.carried}
    try:
        with trial_apply(stack, source):
            pass
    except ApplyConflict as e:
        names = [entry.name for entry in stack.carried]
        failed = names.index(e.entry.name)
        result[names[failed]] = "CONFLICT"
        for name in names[failed + 1 :]:
            result[name] = "not reached"
    return result


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(stack: Stack) -> str:
    """The README's table of what the stack carries."""
    lines = ["| entry | status | upstream PR | purpose |", "|---|---|---|---|"]
    for e in stack.entries:
        status = e.status + (f" in {e.upstreamed_in}" if e.upstreamed_in else "")
        pr = f"[#{e.upstream_pr.rsplit('/', 1)[-1]}]({e.upstream_pr})" if e.upstream_pr else "-"
        lines.append(f"| `{e.name}` | {status} | {pr} | {e.purpose} |")
    return "\n".join(lines)


def print_ports(stack: Stack) -> None:
    """The ports under patches/ports/ and how far each lags the series (reported,
    never a failure: a port is made from the series as it was)."""
    from hybrid_stack.port import RECORD, disk_files, lag, lag_lines, load_record, main_of

    lines = lag_lines(stack.root)
    if lines:
        print("\nports (patches/ports/<version>, made with hybrid-stack port):")
        for line in lines:
            print(f"  {line}")
    main = main_of(stack.root)
    if main is not None:
        r = load_record(stack.root)
        if r is None:
            print(f"\nport of {main}: no {RECORD}, its source is unknown")
        else:
            print(
                f"\nport of the series in {main}, made from {r.commit[:12]}: "
                f"{lag(r, disk_files(main)).text()}"
            )


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root)
    if args.markdown:
        print(markdown(stack))
        return 0
    ok = {} if args.no_apply else applies(stack, args.source)
    rows = [["#", "entry", "status", "upstream PR", "files", "+/-", "applies"]]
    for i, e in enumerate(stack.entries, 1):
        n, add, rem = diff_counts(stack, e)
        status = e.status + (f" in {e.upstreamed_in}" if e.upstreamed_in else "")
        pr = e.upstream_pr.rsplit("/", 1)[-1] if e.upstream_pr else "-"
        rows.append(
            [
                str(i),
                e.name,
                status,
                f"#{pr}" if pr.isdigit() else pr,
                str(n),
                f"+{add}/-{rem}",
                ok.get(e.name, "-" if e.carried and args.no_apply else "n/a"),
            ]
        )
    print(
        f"vLLM {stack.pin.version} ({stack.pin.sdist.filename}) + {len(stack.carried)} "
        "carried entries"
    )
    print(table(rows))
    print_ports(stack)
    return 1 if any(v != "yes" for v in ok.values()) else 0


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="table of the series")
    p.add_argument("--no-apply", action="store_true", help="skip the trial apply")
    p.add_argument("--source", choices=("sdist", "git", "local"), default="sdist")
    p.add_argument("--markdown", action="store_true", help="print the README's table")
    p.set_defaults(func=run)
