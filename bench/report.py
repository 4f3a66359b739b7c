"""The report of `npu-pool bench`: ratios against the ceiling and the peers, the printed
tables and the plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bench.peers.vllm_bench import plot_vllm, print_vllm, vllm_ratios


def ratios(report: dict[str, Any]) -> dict[str, float | None]:
    """The pool against the ceiling (at saturation) and the peers."""
    levels = report["levels"]
    best = max(level["output_tokens_per_s"] for level in levels)
    at_64 = next((lv["output_tokens_per_s"] for lv in levels if lv["concurrency"] == 64), best)
    out: dict[str, float | None] = {
        "pool_over_ceiling": best / report["ceiling"]["output_tokens_per_s"],
        "pool_over_workload_ceiling": max(
            lv["output_tokens_per_s"] / lv["workload_ceiling"]["output_tokens_per_s"]
            for lv in levels
        ),
    }
    if "burst" in report:
        out["burst_ttft_p99_over_ideal"] = report["burst"]["ttft_p99_over_ideal"]
    if "rq_peer" in report:
        out["pool_over_rq_peer_at_64"] = at_64 / report["rq_peer"]["output_tokens_per_s"]
    if "offline_peer" in report:
        out["pool_over_offline_peer"] = best / report["offline_peer"]["output_tokens_per_s"]
    return out | vllm_ratios(report)


def print_report(report: dict[str, Any]) -> None:
    """The levels table, the comparison and the ratios."""
    print(
        f"{'conc':>5}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}"
        f"{'ITL p99':>9}{'e2e p50':>9}{'goodput':>9}{'pad':>6}{'ceil':>8}{'idle':>6}{'host':>6}"
        f"{'coll':>6}"
    )
    for lv in report["levels"]:
        ceiling = lv.get("workload_ceiling", {}).get("output_tokens_per_s")
        print(
            f"{lv['concurrency']:>5}{lv['output_tokens_per_s']:>9.0f}"
            f"{lv['requests_per_s']:>8.1f}{lv['ttft_ms']['p50']:>10.0f}{lv['ttft_ms']['p99']:>8.0f}"
            f"{lv['tpot_ms']['p50']:>10.1f}{lv['itl_ms']['p99']:>9.1f}{lv['e2e_ms']['p50']:>9.0f}"
            f"{lv['goodput_requests_per_s']:>9.1f}{lv['padding_waste']:>6.0%}"
            f"{_share(lv['output_tokens_per_s'] / ceiling if ceiling else None):>8}"
            f"{_share(lv.get('rank_idle_share')):>6}{_share(lv.get('rank_host_share')):>6}"
            f"{_share(lv.get('rank_collective_share')):>6}"
        )
    print(
        "ceil: share of the workload ceiling (its launches back to back); idle: ranks waiting "
        "for a plan; host: share of steps outside launches; coll: share in expert-parallel "
        "collectives"
    )
    print(f"kernel ceiling: {report['ceiling']['output_tokens_per_s']:.0f} tokens/s")
    burst = report.get("burst")
    if burst:
        ttft = burst["ttft_ms"]
        print(
            f"burst of {burst['requests']}: TTFT p50 {ttft['p50']:.0f} / p90 {ttft['p90']:.0f} / "
            f"p99 {ttft['p99']:.0f} ms, ITL p99 {burst['itl_ms']['p99']:.0f} ms; prefill-bound "
            f"ideal {burst.get('prefill_bound_ideal_ms', 0):.0f} ms; prefill efficiency "
            f"{_share(burst['prefill_efficiency'])}, "
            f"{burst['prefill_launches_per_request']:.2f} prefill launches per request"
        )
        if "gateway_ttft_ms" in burst:
            ttft = burst["gateway_ttft_ms"]
            print(
                f"burst of {burst['requests']} through the gateway: TTFT p50 {ttft['p50']:.0f} / "
                f"p90 {ttft['p90']:.0f} / p99 {ttft['p99']:.0f} ms"
            )
    print(
        f"planner: {report['planner_us_per_step']:.0f} us per step "
        "(64 running + 64 waiting, 8 ranks)"
    )
    for peer in ("rq_peer", "offline_peer"):
        if peer in report:
            print(f"{peer.replace('_', ' ')}: {report[peer]['output_tokens_per_s']:.0f} tokens/s")
    if "vllm_offline" in report:
        print_vllm(report)
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.2f}x" if value is not None else f"{name}: n/a")


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput and latency against load, with the ceiling and peers as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "npu-pool bench: matplotlib is not installed; no plot (pip install 'npu-pool[bench]')",
            file=sys.stderr,
        )
        return
    levels = report["levels"]
    x = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(x, [lv["output_tokens_per_s"] for lv in levels], "o-", label="npu-pool")
    left.axhline(report["ceiling"]["output_tokens_per_s"], ls="--", c="k", label="kernel ceiling")
    for peer, style in (("rq_peer", ":"), ("offline_peer", "-.")):
        if peer in report:
            left.axhline(
                report[peer]["output_tokens_per_s"],
                ls=style,
                c="gray",
                label=peer.replace("_", " "),
            )
    if "vllm_offline" in report:
        plot_vllm(left, report)
    left.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s")
    left.legend()
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "end-to-end")):
        right.plot(x, [lv[key]["p50"] for lv in levels], "o-", label=f"{label} p50")
    right.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
