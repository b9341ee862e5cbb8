"""Pictures for people: a grid of images with predicted and true labels."""

from __future__ import annotations

import io
import math
from pathlib import Path

from .run_dir import atomic_write_bytes


def prediction_grid(images, predicted, true, path: Path, *, classes=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(images)
    columns = min(count, max(1, math.ceil(math.sqrt(count))))
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(1.6 * columns, 1.8 * rows), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for i, axis in enumerate(axes.flat[:count]):
        image = images[i].permute(1, 2, 0).numpy()
        axis.imshow(image.squeeze(-1) if image.shape[-1] == 1 else image, cmap="gray")
        mistake = int(predicted[i]) != int(true[i])
        guess, label = (
            (classes[int(predicted[i])], classes[int(true[i])])
            if classes
            else (int(predicted[i]), int(true[i]))
        )
        axis.set_title(
            f"{guess} (true {label})" if mistake else f"{guess}",
            color="red" if mistake else "black",
            fontsize=9,
        )
        if mistake:
            for spine in axis.spines.values():
                spine.set_visible(True)
                spine.set_color("red")
                spine.set_linewidth(2)
            axis.axis("on")
            axis.set_xticks([])
            axis.set_yticks([])
    save_figure(figure, path)


def save_figure(figure, path: Path) -> None:
    """Write `figure` as a PNG atomically (a crash leaves the previous picture) and close it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    atomic_write_bytes(Path(path), buffer.getvalue())
