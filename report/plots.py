"""The report's two PNG plots: speedup against k and against the per-round delay R,
the model's curves with the measured points over them."""

from __future__ import annotations

from pathlib import Path

from report.analysis import Report
from report.model import K_MAX


def write_plots(report: Report, directory: str | Path, k_max: int = K_MAX) -> list[Path]:
    """Writes speedup_vs_k.png and speedup_vs_delay.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = report.model
    measured_delay = report.mean_delay_ns
    paths = []

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    ks = list(range(1, k_max + 1))
    for delay_ns, style in (
        (0.0, ":"),
        (measured_delay, "-"),
        (measured_delay + 10e6, "--"),
        (measured_delay + 40e6, "-."),
    ):
        axes.plot(
            ks,
            [model.speedup(k, delay_ns) for k in ks],
            style,
            label=f"model, R = {delay_ns * 1e-6:.1f} ms",
        )
    if report.points:
        axes.scatter(
            [p.k for p in report.points],
            [p.speedup for p in report.points],
            color="black",
            zorder=3,
            label="measured (one per request)",
        )
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set(
        xlabel="draft tokens per round k",
        ylabel="speedup over target-only",
        title=f"alpha = {model.alpha:.2f}, t_target = {model.target_step_ns * 1e-6:.1f} ms",
    )
    axes.legend(fontsize=8)
    paths.append(_save(figure, directory / "speedup_vs_k.png"))

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    k = max(report.typical_k, 1)
    best = model.best_k(measured_delay, k_max)
    horizon = max(
        2.0 * max(model.break_even_delay_ns(k), model.break_even_delay_ns(best), 1e6),
        max((p.delay_ns for p in report.points), default=0.0) * 1.2,
    )
    delays = [horizon * i / 200 for i in range(201)]
    for curve_k in sorted({k, best}):
        axes.plot(
            [d * 1e-6 for d in delays],
            [model.speedup(curve_k, d) for d in delays],
            label=f"model, k = {curve_k}",
        )
        axes.axvline(
            model.break_even_delay_ns(curve_k) * 1e-6, color="grey", linestyle=":", linewidth=0.8
        )
    if report.points:
        axes.scatter(
            [p.delay_ns * 1e-6 for p in report.points],
            [p.speedup for p in report.points],
            color="black",
            zorder=3,
            label="measured (one per request)",
        )
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set(
        xlabel="per-round delay R (round trip + overhead), ms",
        ylabel="speedup over target-only",
        title="break-even where the curve crosses 1 (dotted)",
    )
    axes.legend(fontsize=8)
    paths.append(_save(figure, directory / "speedup_vs_delay.png"))
    return paths


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
