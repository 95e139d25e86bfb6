"""The report from live Prometheus endpoints (a draft worker's /metrics; a target's too
for its Decode time per token): counters and histograms since the workers started.

Less than a trace gives: no per-request points, and the per-token acceptance alpha is
exact only when every round drafted the same k (then the rounds with a rejection are
the drafts less those that accepted the last position).
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from foundation.pass_cost import PassCost
from report.model import CostModel


def scrape(urls: list[str], timeout_s: float = 10.0) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)] over all endpoints."""
    samples: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for url in urls:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append((sample.labels, sample.value))
    return samples


def _total(samples, name: str, **labels) -> float:
    return sum(
        v
        for sample_labels, v in samples.get(name, ())
        if all(sample_labels.get(k) == str(want) for k, want in labels.items())
    )


def _by_position(samples, name: str) -> dict[int, float]:
    counts: dict[int, float] = defaultdict(float)
    for labels, value in samples.get(name, ()):
        if "position" in labels:
            counts[int(labels["position"])] += value
    return dict(counts)


def render_live(samples, target_step_ns: float | None = None) -> str:
    rounds = _total(samples, "specdec_rounds_total")
    drafts = _total(samples, "specdec_drafts_total")
    drafted = _by_position(samples, "specdec_draft_tokens_total")
    accepted = _by_position(samples, "specdec_accepted_tokens_total")
    if not rounds:
        return "no specdec_rounds_total samples: is this a draft worker's /metrics with traffic?"
    num_drafted, num_accepted = sum(drafted.values()), sum(accepted.values())
    k_max = max(drafted, default=-1) + 1
    lines = [
        f"rounds: {rounds:.0f} ({drafts:.0f} drafting), drafted {num_drafted:.0f}, accepted {num_accepted:.0f}",
        f"acceptance rate: {num_accepted / num_drafted:.1%} of drafted tokens"
        if num_drafted
        else "nothing drafted",
        f"mean accepted length: {num_accepted / drafts:.2f} tokens per drafting round"
        if drafts
        else "",
        "acceptance by position: "
        + " ".join(
            f"{i + 1}:{accepted.get(i, 0) / drafted[i]:.0%}" for i in sorted(drafted) if drafted[i]
        ),
    ]
    phases = {}
    for phase in ("draft", "verify_compute", "network"):
        count = _total(samples, "specdec_round_duration_seconds_count", phase=phase)
        phases[phase] = (
            _total(samples, "specdec_round_duration_seconds_sum", phase=phase) / count * 1e9
            if count
            else 0.0
        )
    lines.append(
        "time per round (mean): " + ", ".join(f"{p} {ns * 1e-6:.2f} ms" for p, ns in phases.items())
    )
    tpot_count = _total(samples, "gen_ai_server_time_per_output_token_seconds_count")
    if tpot_count:
        mean = _total(samples, "gen_ai_server_time_per_output_token_seconds_sum") / tpot_count
        lines.append(
            f"time per output token (mean over {tpot_count:.0f} calls, all scraped services): {mean * 1e3:.2f} ms"
        )
    if target_step_ns and num_drafted and drafts:
        full = accepted.get(k_max - 1, 0.0)
        alpha = num_accepted / (num_accepted + drafts - full)
        model = CostModel(
            alpha,
            target_step_ns,
            phases["draft"] * rounds / num_drafted,
            PassCost(phases["verify_compute"]),  # flat: the metrics hold no width
            draft_fraction=drafts / rounds,
        )
        k = round(num_drafted / drafts)
        lines.append(
            f"model at k={k} (alpha {alpha:.3f}, flat t_verify {phases['verify_compute'] * 1e-6:.2f} ms): "
            f"speedup {model.speedup(k, phases['network']):.2f}x at the measured network time, break-even "
            f"round-trip delay {model.break_even_delay_ns(k) * 1e-6:.2f} ms"
        )
    return "\n".join(line for line in lines if line)
