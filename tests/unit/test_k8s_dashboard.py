"""The Grafana dashboard and the PromQL that reads the processes' metrics."""

from __future__ import annotations

import json
import re

from tests.unit.k8s_metrics import (
    DASHBOARD,
    exported_metric_names,  # noqa: F401 (a fixture, and the one it uses)
    metric_names_by_process,  # noqa: F401
    promql_metric_names,
)


def test_promql_metric_names_reads_what_the_dashboard_writes():
    expr = (
        'histogram_quantile(0.99, sum by (namespace, le) (rate(tpserve_ttft_bucket{namespace=~"$ns", '
        'x="a{b}"}[$__rate_interval]))) / on (pod) group_left sum(up offset 5m) > bool 1e3'
    )
    assert promql_metric_names(expr) == {"tpserve_ttft_bucket", "up"}


DASHBOARD_MUST_READ = {
    "tpserve_generation_tokens_total",  # output throughput
    "tpserve_time_to_first_token_seconds_bucket",
    "tpserve_time_per_output_token_seconds_bucket",
    "tpserve_e2e_request_latency_seconds_bucket",
    "tpserve_kv_usage_ratio",
    "tpserve_batch_size_sum",
    "tpserve_batch_tokens_sum",
    "tpserve_num_requests_running",
    "tpserve_num_requests_waiting",
    "tpserve_forward_duration_seconds_bucket",
    "tpserve_allreduce_duration_seconds_bucket",
    "tpserve_preemptions_total",
    "tpserve_requests_finished_total",
    "tpserve_requests_failed_total",
    "tpserve_device_memory_used_bytes",
}


def _dashboard_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _dashboard_panels(panel.get("panels", []))  # a collapsed row holds its panels


def test_grafana_dashboard_reads_only_metrics_the_processes_export(exported_metric_names):  # noqa: F811 (the fixture)
    dashboard = json.loads(DASHBOARD.read_text())
    # Importable as is: no instance id, a stable uid, the Prometheus data source picked by a variable.
    assert dashboard["id"] is None and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = next(v for v in variables.values() if v["type"] == "datasource")
    assert source["query"] == "prometheus"
    picked = {"type": "prometheus", "uid": f"${{{source['name']}}}"}
    panels = list(_dashboard_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    expressions = []
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == picked, variable["name"]
            (metric,) = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["query"]).groups()
            expressions.append((variable["name"], metric))
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for cell in {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}:
            assert cell not in cells, f"{panel['title']} overlaps another panel"
            cells.add(cell)
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == picked, panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", picked) == picked, panel["title"]
            expressions.append((panel["title"], target["expr"]))
    read = set()
    for where, expr in expressions:
        names = promql_metric_names(expr)
        assert names, f"{where}: {expr} selects no metric"
        unknown = names - exported_metric_names
        assert not unknown, f"{where}: no process exports {sorted(unknown)}"
        read |= names
        # rate() of a counter-like series only; quantiles from buckets, grouped by le.
        for fn, arg in re.findall(r"\b(rate|irate|increase)\(\s*([\w:]+)", expr):
            assert arg.endswith(("_total", "_bucket", "_sum", "_count")), f"{where}: {fn}({arg})"
        for inner in re.findall(r"histogram_quantile\(\s*[\d.]+\s*,(.*)", expr):
            assert "_bucket" in inner and re.search(r"by \([^)]*\ble\b", inner), f"{where}: {expr}"
    assert read >= DASHBOARD_MUST_READ, f"no panel reads {sorted(DASHBOARD_MUST_READ - read)}"
