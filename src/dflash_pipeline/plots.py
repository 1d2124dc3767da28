"""Figures of the workflow's reports (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_training_curves(rows: list[dict], path, block_size: int) -> None:
    """Loss (train and validation), validation per-slot accuracy and acceptance proxy against the step."""
    train = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    val = [r for r in rows if r.get("val_loss") is not None]
    steps = [r["step"] for r in val]
    fig, (ax_loss, ax_acc, ax_proxy) = plt.subplots(1, 3, figsize=(15, 4.2))
    if train:
        ax_loss.plot(*zip(*train), lw=0.8, alpha=0.7, label="train")
    ax_loss.plot(steps, [r["val_loss"] for r in val], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="weighted cross-entropy", title="loss", yscale="log")
    ax_loss.legend()
    slots = sorted({k for k in (1, 2, 3, 4, 8, block_size - 1) if 1 <= k < block_size})
    for k in slots:
        ax_acc.plot(steps, [r[f"val_acc_{k}"] for r in val], "o-", ms=3, label=f"slot {k}")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="validation accuracy per block slot", ylim=(0, None))
    ax_acc.legend(fontsize="small")
    ax_proxy.plot(steps, [r["val_proxy"] for r in val], "o-", color="C3")
    ax_proxy.set(xlabel="step", ylabel="tokens per block", ylim=(1, None),
                 title="teacher-forced acceptance proxy (validation)")
    for ax in (ax_loss, ax_acc, ax_proxy):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
