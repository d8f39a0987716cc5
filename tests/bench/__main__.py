"""``python -m tests.bench [NAME ...] [--quick] [--runs N] [--out PATH]`` (``make bench``).

Runs the benchmarks (all, or those named), prints a table per benchmark and, for a full run,
writes them to docs/benchmarks.md. A benchmark that cannot run (a feature missing, a server
that would not start) says so in its table; the others still run.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from tests.bench import machine
from tests.bench.processes import BenchError
from tests.bench.report import Section, render_document, render_section, render_summary
from tests.bench.suite import Context, registry, shm_dir, workdir

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DOC = REPO / "docs" / "benchmarks.md"
# What follows this line in the report (hand-written sections: measured comparisons between
# versions, with their commands) is kept when the report is written again.
KEPT_MARKER = "<!-- make bench keeps everything below this line -->"

PREAMBLE = """
Written by `make bench` (`python -m tests.bench`); do not edit by hand, except below the
closing marker line (hand-written comparisons between versions, which `make bench` keeps).

Every row measures ckptdrain (*ours*) and a baseline side by side in one run, on the same data
and the same disk, several times, alternating their order; the figures are medians, with the
lowest and highest run in brackets. The **ratio** is ours / baseline. Absolute figures on this
shared machine are noise; the ratio is the figure to watch. *Bounded by* says what limits both
sides, so a ratio near 1 means ckptdrain adds little on top of what the machine allows.
Select benchmarks with `python -m tests.bench NAME ...` (`--list` names them); `--quick`
runs small sizes once (a smoke test, not a measurement); `--workdir DIR` puts staging and the
file:// destinations on the disk you want measured (a node's NVMe), `--runs N` overrides the
number of runs, `--versus DIR` also runs another ckptdrain tree side by side (`ranks`, `busy`).
Targets are the issue's; a row that cannot run says why instead of failing.
"""


def parse_args(argv: Sequence[str], names: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.bench",
        description="ckptdrain benchmarks: ratios against plain baselines, side by side.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run (default: all): {', '.join(names)}")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, one or two runs: checks the harness, measures nothing")
    p.add_argument("--runs", type=int, default=None, help="runs per measurement (overrides)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the Markdown report here (default: docs/benchmarks.md for a full "
                        "run of every benchmark, nowhere otherwise)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where to stage and write (default: the system temp dir); it is the "
                        "disk the benchmarks measure")
    p.add_argument("--versus", type=Path, default=None, metavar="DIR",
                   help="also run ckptdrain from DIR (DIR/ckptdrain/{client,daemon}, e.g. "
                        "`git archive REV client daemon | tar -x -C DIR/ckptdrain`) side by "
                        "side, in the benchmarks that support it (ranks, busy): a before/after "
                        "in one run")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any benchmark failed to run to the end")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ns = p.parse_args(argv)
    unknown = [n for n in ns.names if n not in names]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    if ns.runs is not None and ns.runs < 1:
        p.error("--runs must be at least 1")
    if ns.versus is not None and not (ns.versus / "ckptdrain" / "daemon" / "server.py").is_file():
        p.error(f"--versus {ns.versus}: no ckptdrain/daemon/server.py in it")
    return ns


def kept_tail(out: Path) -> str:
    """The hand-written end of an existing report, from KEPT_MARKER on ("" when none)."""
    try:
        text = out.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""
    at = text.find(KEPT_MARKER)
    return "" if at < 0 else "\n" + text[at:]


def compile_measured(versus: Path | None) -> None:
    """Byte-compile the ckptdrain trees measured, as a packaged install has them (the deb's
    postinst compiles; an editable install does not): otherwise, where PYTHONDONTWRITEBYTECODE
    is set, every daemon, worker and command compiles its modules as it starts, a cost no
    installed node pays."""
    trees = [REPO / "client", REPO / "daemon"]
    if versus is not None:
        trees.append(versus / "ckptdrain")
    for tree in trees:
        compileall.compile_dir(str(tree), quiet=1)


def main(argv: Sequence[str] | None = None) -> int:
    benches = registry()
    ns = parse_args(sys.argv[1:] if argv is None else argv, list(benches))
    if ns.list:
        for b in benches.values():
            print(f"{b.name:10} {b.title}")
        return 0
    chosen = [benches[n] for n in ns.names] if ns.names else list(benches.values())
    out = ns.out
    if out is None and not ns.names and not ns.quick and ns.runs is None and ns.versus is None:
        out = DEFAULT_DOC

    def say(msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    compile_measured(ns.versus)
    sections: list[Section] = []
    started = time.monotonic()
    with workdir(ns.workdir) as work, shm_dir() as shm:
        description = machine.describe(work, shm)
        if not ns.quick:
            say("touching free memory once (a fresh VM backs it on first touch)")
            description.append(machine.touch_memory())
        for bench in chosen:
            section = Section(name=bench.name, title=bench.title, what=bench.what)
            sections.append(section)
            say(f"{bench.name}: {bench.title}")
            t0 = time.monotonic()
            # One ExitStack per benchmark: its daemons and servers are gone before the next.
            with contextlib.ExitStack() as stack:
                ctx = Context(quick=ns.quick, runs_override=ns.runs, work=work, shm=shm,
                              stack=stack, say=say,
                              versus=ns.versus.resolve() if ns.versus else None)
                try:
                    bench.run(ctx, section)
                except KeyboardInterrupt:
                    raise
                except BenchError as exc:
                    section.error = str(exc).splitlines()[0][:300]
                    say(f"{bench.name} did not finish: {exc}")
                except Exception as exc:
                    section.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    say(f"{bench.name} failed:\n{traceback.format_exc()}")
            section.elapsed_s = time.monotonic() - t0
            say(f"{bench.name}: done in {section.elapsed_s:.0f} s")
            print(render_section(section), flush=True)
    total = time.monotonic() - started
    print("## Summary\n\n" + render_summary(sections) + "\n")
    description.append(f"Wall time of this run: {total / 60:.1f} min"
                       + (" (--quick: sizes and runs cut, not a measurement)" if ns.quick else ""))
    if out is not None:
        command = "python -m tests.bench" + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
        out.parent.mkdir(parents=True, exist_ok=True)
        text = render_document(sections, description, command, PREAMBLE)
        out.write_text(text.rstrip("\n") + "\n" + kept_tail(out))
        say(f"wrote {out}")
    failed = [s.name for s in sections if s.error]
    if failed:
        say(f"did not finish: {', '.join(failed)}")
        if ns.strict:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
