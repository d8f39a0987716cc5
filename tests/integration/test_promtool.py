"""Prometheus artefacts checked by the real tools: promtool on the alert rules, their unit tests,
the scrape config, every dashboard expression and the metrics exposition; then a real
Prometheus server scraping a live endpoint, evaluating the rules and every dashboard query."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ckptdrain.daemon.metrics import Metrics
from ckptdrain.daemon.metricsgauges import Snapshot

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
ALERTS_TEST = PROM_DIR / "alerts_test.yml"
SCRAPE = PROM_DIR / "scrape.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ckptdrain.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"

TOOL_TIMEOUT_S = 60
PROMETHEUS_START_TIMEOUT_S = 60
PROMETHEUS_STOP_TIMEOUT_S = 10
WAIT_TIMEOUT_S = 60

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing: `make system-deps` installs it"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus missing: `make system-deps` installs it"
)

EXPECTED_ALERTS = {
    "CkptdrainOldestUndrainedTooOld",
    "CkptdrainStagingNearlyFull",
    "CkptdrainArrivalExceedsDrain",
    "CkptdrainDrainErrors",
    "CkptdrainGenerationFailed",
    "CkptdrainInternalError",
    "CkptdrainNoRecentCommit",
    "CkptdrainConfigNotApplied",
    "CkptdrainDown",
}

# What Grafana would put in place of each dashboard variable, for a query Prometheus accepts.
SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "${instance}": ".*",
    "$instance": ".*",
    "${training_job}": ".*",
    "$training_job": ".*",
    "$objective": "900",
}


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args],
        input=stdin,
        capture_output=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )


def output(result: subprocess.CompletedProcess[bytes]) -> str:
    return (result.stdout + result.stderr).decode(errors="replace")


@dataclass
class Alert:
    name: str
    runbook_url: str


def alert_rules() -> list[Alert]:
    """The alerts in alerts.yml (no YAML library in the environment: the file's layout is
    regular, and promtool validates its structure in test_rules_check)."""
    text = ALERTS.read_text()
    alerts = []
    for chunk in re.split(r"^\s*- alert: ", text, flags=re.M)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        url = re.search(r'^\s*runbook_url: "([^"]+)"', chunk, flags=re.M)
        alerts.append(Alert(name, url[1] if url else ""))
    return alerts


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return expr


@dataclass
class PanelQuery:
    where: str
    expr: str  # variables substituted


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[PanelQuery]:
    """Every panel target's expression, and the selector inside every variable query."""
    dash = dashboard()
    queries = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            where = f"panel {panel['id']} {panel['title']!r} target {target['refId']}"
            queries.append(PanelQuery(where, substitute(target["expr"])))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *(\w+)\)", var["definition"])
            assert match, var["definition"]
            queries.append(PanelQuery(f"variable {var['name']}", substitute(match[1])))
    return queries


def populated_metrics(now: float | None = None) -> Metrics:
    """A Metrics object with every family holding samples, as a busy daemon would."""
    now = time.monotonic() if now is None else now  # the snapshot's moments are monotonic
    m = Metrics("gpu017", "0.1.0")
    m.set_snapshot(
        Snapshot(
            oldest_undrained_since={"llama": now - 1000.0, "bert": None},
            shards_by_state={"receiving": 1, "staged": 5, "draining": 2, "drained": 9, "failed": 1},
            staged_bytes={"local": 700 * 2**30, "memory": 3 * 2**30},
            limit_bytes={"local": 800 * 2**30, "memory": 64 * 2**30},
            queued_shards=8,
            max_queued_shards=100_000,
            staging_free_bytes=900 * 2**30,
            staging_free_inodes=5_000_000,
            generations_in_flight={"llama": 2, "bert": 1},
            blocked_handoffs=1,
            drain_rate_bytes_per_s=1.2e9,
        )
    )
    for job in ("llama", "bert"):
        m.handoff(job, 0.004, 2**30, "local")
        m.handoff(job, 0.0008, 2**20, "memory")
        m.drained(job, 2**30, "s3")
    m.drain_error("s3", "throttled")
    m.backpressure("blocked", "max_staged_bytes")
    m.upload_aborted()
    clocks = {"started": now - 400, "handoff": now - 390, "staged": now - 380, "drained": now - 100}
    m.generation_committed("llama", 1200, clocks, committed_at=now - 60)
    m.generation_committed("bert", 300, clocks, committed_at=now - 60)
    m.generation_failed("bert", "conflict")
    return m


def exposition_names(m: Metrics) -> set[str]:
    return {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in m.exposition().decode().splitlines()
        if line and not line.startswith("#")
    }


# -- rules -----------------------------------------------------------------------------------


@needs_promtool
def test_rules_check() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, output(result)
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in output(result)


@needs_promtool
def test_rules_unit_tests() -> None:
    result = promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, output(result)
    assert "SUCCESS" in output(result)


def test_every_alert_is_there_and_unit_tested() -> None:
    names = {a.name for a in alert_rules()}
    assert names == EXPECTED_ALERTS
    tested = set(re.findall(r"^\s*alertname: (\w+)", ALERTS_TEST.read_text(), flags=re.M))
    assert tested == EXPECTED_ALERTS


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_every_runbook_url_points_to_a_section_of_the_runbook() -> None:
    headings = re.findall(r"^#{1,6} (.+)$", OPERATIONS_DOC.read_text(), flags=re.M)
    anchors = {github_anchor(h) for h in headings}
    for alert in alert_rules():
        path, _, anchor = alert.runbook_url.partition("#")
        assert path == "docs/operations.md", alert
        assert anchor == alert.name.lower(), alert
        assert anchor in anchors, f"docs/operations.md has no section for {alert.name}"


@needs_promtool
def test_scrape_config_check() -> None:
    # Also checks the rule file it names, relative to itself.
    result = promtool("check", "config", str(SCRAPE))
    assert result.returncode == 0, output(result)


# -- dashboard ------------------------------------------------------------------------------


def test_dashboard_model() -> None:
    dash = dashboard()
    assert dash["uid"] == "ckptdrain"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    assert variables["instance"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine


def test_dashboard_has_the_panels_operators_need() -> None:
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for needed in (
        "oldest undrained age vs objective",
        "arrival vs drain rate",
        "staged bytes vs limits",
        "hand-off stall quantiles",
        "four clocks",
        "drain errors",
        "backpressure",
        "committed",
    ):
        assert needed in titles


@needs_promtool
def test_every_dashboard_expression_passes_promtool(tmp_path: Path) -> None:
    queries = dashboard_queries()
    # Each expression as a recording rule: `promtool check rules` parses and checks it.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": q.expr}
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps(rules, indent=1))  # JSON is YAML
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, (
        output(result)
        + "\n"
        + "\n".join(f"{i}: {q.where}: {q.expr}" for i, q in enumerate(queries))
    )
    assert f"SUCCESS: {len(queries)} rules found" in output(result)


def test_rules_and_dashboard_only_use_metrics_the_daemon_exports() -> None:
    exported = exposition_names(populated_metrics())
    used = set(re.findall(r"\bckptdrain_[a-z_]+", ALERTS.read_text()))
    used |= {
        name for q in dashboard_queries() for name in re.findall(r"\bckptdrain_[a-z_]+", q.expr)
    }
    assert used - exported == set()
    # ...and every exported family is on the dashboard or in an alert.
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    uncovered = {f for f in families if not any(u.startswith(f) for u in used)}
    assert uncovered == set()


def test_provisioning_files_name_what_grafana_needs() -> None:
    dashboards = (PROVISIONING / "dashboards.yml").read_text()
    datasources = (PROVISIONING / "datasources.yml").read_text()
    assert re.search(r"^apiVersion: 1$", dashboards, flags=re.M)
    assert re.search(r"^\s+type: file$", dashboards, flags=re.M)
    assert re.search(r"^\s+path: /\S+$", dashboards, flags=re.M)
    assert re.search(r"^apiVersion: 1$", datasources, flags=re.M)
    assert re.search(r"^\s+type: prometheus$", datasources, flags=re.M)


# -- exposition -----------------------------------------------------------------------------


@needs_promtool
def test_exposition_passes_promtool_check_metrics() -> None:
    result = promtool("check", "metrics", stdin=populated_metrics().exposition())
    assert result.returncode == 0, output(result)
    assert output(result).strip() == ""


@needs_promtool
def test_promtool_check_metrics_is_not_a_rubber_stamp() -> None:
    bad = b"# HELP ckptdrain_things x\n# TYPE ckptdrain_things counter\nckptdrain_things 1\n"
    assert promtool("check", "metrics", stdin=bad).returncode != 0


# -- a real Prometheus ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def _get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)

    async def get(self, path: str, **params: str) -> Any:
        return await asyncio.to_thread(self._get, path, **params)

    async def query(self, expr: str) -> list[dict[str, Any]]:
        body = await self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def wait_for(self, what: str, expr: str) -> list[dict[str, Any]]:
        """Poll until ``expr`` has a result (the data it needs has been scraped)."""
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while True:
            result = await self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {expr}")
            await asyncio.sleep(0.2)


@contextlib.contextmanager
def prometheus_process(config: Path, data: Path, port: int, log: Path) -> Iterator[None]:
    assert PROMETHEUS is not None
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            yield
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=PROMETHEUS_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=PROMETHEUS_STOP_TIMEOUT_S)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scraped(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Metrics, Prometheus]]:
    """A live metrics endpoint and a real Prometheus scraping it every second with the
    project's alert rules loaded; started once for the tests below (it takes seconds)."""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    m = populated_metrics()
    _, metrics_port = await m.serve("127.0.0.1", 0)
    prom_port = free_port()
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            {
                # The same job name and label handling as deploy/prometheus/scrape.yml.
                "job_name": "ckptdrain",
                "honor_labels": False,
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    log = tmp_path / "prometheus.log"
    try:
        with prometheus_process(tmp_path / "prometheus.yml", tmp_path / "data", prom_port, log):
            prom = Prometheus(prom_port)
            deadline = time.monotonic() + PROMETHEUS_START_TIMEOUT_S
            while True:
                try:
                    await asyncio.to_thread(urllib.request.urlopen, f"{prom.base}/-/ready", None, 2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"prometheus did not start:\n{log.read_text()}"
                        ) from None
                    await asyncio.sleep(0.2)
            # Three scrapes: enough samples for rate() over the dashboards' 1m windows.
            await prom.wait_for("three scrapes", 'count_over_time(up{job="ckptdrain"}[1m]) >= 3')
            yield m, prom
    finally:
        await m.aclose()


@needs_prometheus
@pytest.mark.asyncio(loop_scope="module")
async def test_real_prometheus_scrapes_with_the_labels_the_rules_expect(
    scraped: tuple[Metrics, Prometheus],
) -> None:
    _, prom = scraped
    assert [r["value"][1] for r in await prom.query('up{job="ckptdrain"}')] == ["1"]
    # The daemon's `job` label lands as `exported_job`, beside the scrape job.
    ages = await prom.query("ckptdrain_oldest_undrained_age_seconds")
    assert {(r["metric"]["job"], r["metric"]["exported_job"]) for r in ages} == {
        ("ckptdrain", "llama"),
        ("ckptdrain", "bert"),
    }


@needs_prometheus
@pytest.mark.asyncio(loop_scope="module")
async def test_every_dashboard_query_returns_data_from_a_live_daemon(
    scraped: tuple[Metrics, Prometheus],
) -> None:
    _, prom = scraped
    empty = [f"{q.where}: {q.expr}" for q in dashboard_queries() if not await prom.query(q.expr)]
    assert empty == []


@needs_prometheus
@pytest.mark.asyncio(loop_scope="module")
async def test_rules_evaluate_cleanly_and_alerts_fire_on_live_data(
    scraped: tuple[Metrics, Prometheus],
) -> None:
    m, prom = scraped
    # A failure after scraping began: the counter existed at 0, so increase() sees it.
    m.generation_failed("llama", "timeout")
    await prom.wait_for(
        "the failed generation alert",
        'ALERTS{alertname="CkptdrainGenerationFailed", exported_job="llama", reason="timeout", '
        'alertstate="firing"}',
    )
    # The oldest undrained shard of llama is 1000 s old: pending for its 5m `for`.
    await prom.wait_for(
        "the oldest undrained alert",
        'ALERTS{alertname="CkptdrainOldestUndrainedTooOld", exported_job="llama", '
        'alertstate="pending"}',
    )
    body = await prom.get("/api/v1/rules")
    rules = [rule for group in body["data"]["groups"] for rule in group["rules"]]
    assert {r["name"] for r in rules} == EXPECTED_ALERTS
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    # bert drained everything (age 0) and failed before the scrape began: no alert for it.
    assert not await prom.query('ALERTS{exported_job="bert"}')


def test_stat_thresholds_follow_the_objective_and_the_alerts() -> None:
    """A stat panel colours against what the operators set, not a number copied beside it:
    the oldest undrained age against the dashboard's objective variable, the time since the
    last commit against CkptdrainNoRecentCommit's threshold."""
    stats = {p["title"]: p for p in dashboard()["panels"] if p["type"] == "stat"}
    oldest = stats["Oldest undrained age / objective"]
    assert oldest["targets"][0]["expr"].rstrip().endswith("/ $objective")
    steps = [s["value"] for s in oldest["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 0.5, 1]
    assert oldest["fieldConfig"]["defaults"]["unit"] == "percentunit"
    overdue = re.search(r"time\(\) - ckptdrain_last_commit_timestamp_seconds > (\d+)",
                        ALERTS.read_text().split("alert: CkptdrainNoRecentCommit", 1)[1])
    assert overdue
    since = stats["Time since last commit"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert since[-1] == {"color": "red", "value": int(overdue[1])}
    for title, panel in stats.items():
        for target in panel["targets"]:
            if "oldest_undrained" in target["expr"]:
                assert "$objective" in target["expr"], title
