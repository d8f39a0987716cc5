"""What a benchmark found, and how it is shown: rows of medians, ratios and targets. Pure.

A row compares *ours* (ckptdrain) with a *baseline* measured side by side in the same run, on
the same data and disk. The ratio is the figure that matters: absolute times on a shared
2-core machine are noise, the ratio of two things measured moments apart much less so.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# How a figure is printed, by unit.
Unit = Literal["s", "B/s", "1/s", "B", "cpu-s/GB", "cpu-s", "cores"]


@dataclass(frozen=True)
class Figure:
    """One measured quantity: every run's value, summarised by the median."""

    samples: tuple[float, ...]
    unit: Unit

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a figure needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def show(self) -> str:
        text = human(self.median, self.unit)
        if len(self.samples) > 1:
            low, high = min(self.samples), max(self.samples)
            lo, hi = human(low, self.unit), human(high, self.unit)
            # Bare numbers when both ends share the median's suffix (ms, s, MB/s); otherwise
            # each end keeps its own (``893.4 ms-3.02 s``), never a mix of unlabelled units.
            suffix = text.rpartition(" ")[2]
            if lo.endswith(" " + suffix) and hi.endswith(" " + suffix):
                lo, hi = human(low, self.unit, bare=True), human(high, self.unit, bare=True)
            text += f" ({lo}-{hi})"
        return text


def figure(samples: Sequence[float], unit: Unit) -> Figure:
    return Figure(tuple(float(s) for s in samples), unit)


@dataclass(frozen=True)
class Target:
    """``ratio <= value`` or ``ratio >= value``."""

    op: Literal["<=", ">="]
    value: float

    def met(self, ratio: float) -> bool:
        return ratio <= self.value if self.op == "<=" else ratio >= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass
class Row:
    """One line of a benchmark's table.

    ``status`` is empty for a measured row; otherwise it says why there are no figures
    ("not available yet: ...", "failed: ..."). ``limit`` is an absolute bound on ``ours``
    (peak RSS), checked besides or instead of a ratio target.
    """

    case: str
    baseline_name: str
    ours: Figure | None = None
    baseline: Figure | None = None
    target: Target | None = None
    limit: tuple[Literal["<=", ">="], float] | None = None
    bound: str = ""
    status: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.baseline is None or self.baseline.median == 0:
            return None
        return self.ours.median / self.baseline.median

    @property
    def met(self) -> bool | None:
        """Whether every target this row has is met; None when there is nothing to judge."""
        verdicts: list[bool] = []
        ratio = self.ratio
        if self.target is not None and ratio is not None:
            verdicts.append(self.target.met(ratio))
        if self.limit is not None and self.ours is not None:
            op, value = self.limit
            for fig in (self.ours, self.baseline):
                if fig is not None and fig.unit == self.ours.unit:
                    verdicts.append(fig.median <= value if op == "<=" else fig.median >= value)
        if not verdicts:
            return None
        return all(verdicts)

    def target_text(self) -> str:
        parts = []
        if self.target is not None:
            parts.append(f"ratio {self.target}")
        if self.limit is not None and self.ours is not None:
            parts.append(f"each {self.limit[0]} {human(self.limit[1], self.ours.unit)}")
        return ", ".join(parts) or "none set"


@dataclass
class Section:
    """One benchmark: its table and what to know to read it."""

    name: str
    title: str
    what: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    elapsed_s: float = 0.0


def human(value: float, unit: Unit, *, bare: bool = False) -> str:
    """``value`` in a readable unit; ``bare`` leaves the unit off (for ranges)."""
    if unit == "s":
        text, suffix = (f"{value * 1e3:.1f}", "ms") if value < 1 else (f"{value:.2f}", "s")
    elif unit == "B/s":
        text, suffix = f"{value / 1e6:.0f}" if value >= 1e8 else f"{value / 1e6:.1f}", "MB/s"
    elif unit == "1/s":
        text, suffix = f"{value:.0f}", "/s"
    elif unit == "B":
        text, suffix = f"{value / MiB:.0f}", "MiB"
    elif unit == "cores":
        text, suffix = f"{value:.2f}", "cores"
    elif unit == "cpu-s":
        text, suffix = f"{value:.2f}", "CPU s"
    else:
        text, suffix = f"{value:.2f}", "CPU s/GB"
    if bare:
        return text
    return f"{text} {suffix}" if suffix != "/s" else f"{text}/s"


def busy(cpu_s: Sequence[float], wall_s: Sequence[float]) -> str:
    """How busy a process kept the CPU, as the median over runs of CPU time / wall time:
    near 100% of a core a single-threaded side is CPU-bound; far below it, it waits on I/O."""
    shares = [c / w for c, w in zip(cpu_s, wall_s, strict=True) if w > 0]
    if not shares:
        return "?"
    return f"{statistics.median(shares):.0%} of a core"


def per_thread(deltas: Sequence[Mapping[str, float]], wall_s: Sequence[float],
               gb: float) -> str:
    """The daemon's CPU by kind of thread (``processes.thread_cpu`` deltas, one per run), as
    the median over runs of cores busy (CPU s / wall s) and, in brackets, CPU s per GB."""
    if not deltas:
        return "?"
    parts = []
    for kind in ("loop", "pump", "io", "journal", "drain", "other", "all"):
        cores = statistics.median(d.get(kind, 0.0) / w for d, w in zip(deltas, wall_s, strict=True))
        per_gb = statistics.median(d.get(kind, 0.0) / gb for d in deltas)
        parts.append(f"{kind} {cores:.2f} ({per_gb:.2f} s/GB)")
    return "daemon threads, cores (CPU s/GB): " + ", ".join(parts)


def size_text(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _verdict(row: Row) -> str:
    met = row.met
    return "-" if met is None else ("yes" if met else "**no**")


def render_section(section: Section) -> str:
    """The section as Markdown: a heading, what it measures, the table, its notes."""
    out = [f"## {section.title} (`{section.name}`)", "", section.what.strip(), ""]
    if section.error:
        out += [f"**Did not run to the end:** {section.error}", ""]
    if section.rows:
        out += [
            "| case | ours | baseline | ratio | target | met | runs | bounded by |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in section.rows:
            runs = max((len(f.samples) for f in (row.ours, row.baseline) if f), default=0)
            if row.status:
                out.append(f"| {row.case} | {row.status} | {row.baseline_name} | - | "
                           f"{row.target_text()} | - | 0 | {row.bound} |")
                continue
            ours = row.ours.show() if row.ours else "-"
            base = f"{row.baseline_name}: {row.baseline.show()}" if row.baseline else row.baseline_name
            ratio = f"{row.ratio:.2f}" if row.ratio is not None else "-"
            out.append(f"| {row.case} | {ours} | {base} | {ratio} | {row.target_text()} | "
                       f"{_verdict(row)} | {runs} | {row.bound} |")
        out.append("")
    notes = list(section.notes) + [n for row in section.rows for n in row.notes]
    if notes:
        out += [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def render_summary(sections: Sequence[Section]) -> str:
    """One line per row across all benchmarks: the ratios at a glance."""
    out = ["| benchmark | case | ratio | target | met |", "|---|---|---|---|---|"]
    for section in sections:
        if section.error and not section.rows:
            out.append(f"| {section.name} | (did not run) | - | - | - |")
        for row in section.rows:
            ratio = row.status or (f"{row.ratio:.2f}" if row.ratio is not None else "-")
            out.append(f"| {section.name} | {row.case} | {ratio} | {row.target_text()} | "
                       f"{_verdict(row)} |")
    return "\n".join(out)


def render_document(sections: Sequence[Section], machine: Sequence[str], command: str,
                    preamble: str) -> str:
    """docs/benchmarks.md: how to read it, the machine, a summary, a table per benchmark."""
    out = ["# Benchmarks", "", preamble.strip(), "", "## Machine and run", ""]
    out += [f"- {line}" for line in machine]
    out += [f"- Command: `{command}`", "", "## Summary", "", render_summary(sections), ""]
    out += [render_section(s) for s in sections]
    return "\n".join(out).rstrip() + "\n"
