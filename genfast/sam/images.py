"""Drawing SAM's masks for `genfast segment`: mask PNGs, label maps and a coloured overlay (the
files themselves are read and written by genfast/interface/images.py)."""

from __future__ import annotations

import colorsys
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw

OVERLAY_ALPHA = 0.45
_FIRST_COLOURS = [(30, 144, 255), (255, 140, 0), (50, 205, 50), (220, 20, 60), (148, 0, 211), (255, 215, 0)]


def colour(index: int) -> tuple[int, int, int]:
    """A distinct, deterministic colour per mask index."""
    if index < len(_FIRST_COLOURS):
        return _FIRST_COLOURS[index]
    r, g, b = colorsys.hsv_to_rgb((index * 0.618033988749895) % 1.0, 0.7, 0.95)
    return round(r * 255), round(g * 255), round(b * 255)


def mask_image(mask: np.ndarray) -> Image.Image:
    """A boolean HxW mask as an 8-bit grayscale image: 255 inside, 0 outside."""
    return Image.fromarray(np.where(mask, 255, 0).astype(np.uint8))


def label_image(masks: Sequence[np.ndarray], shape: tuple[int, int]) -> Image.Image:
    """Mask i painted with value i + 1 over a 0 background, later masks on top; 8-bit when there
    are at most 255 masks, else 16-bit."""
    dtype = np.uint8 if len(masks) <= 255 else np.uint16
    labels = np.zeros(shape, dtype=dtype)
    for i, mask in enumerate(masks):
        labels[mask] = i + 1
    return Image.fromarray(labels)


def overlay_image(
    image: np.ndarray,
    masks: Sequence[np.ndarray],
    colours: Sequence[tuple[int, int, int]],
    points: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    box: Sequence[float] | None = None,
) -> Image.Image:
    """The image with each mask tinted in its colour (later masks on top) and outlined, and the
    prompt drawn: foreground points green, background points red, the box green."""
    out = image.astype(np.float32)
    for mask, rgb in zip(masks, colours):
        out[mask] = (1 - OVERLAY_ALPHA) * out[mask] + OVERLAY_ALPHA * np.asarray(rgb, dtype=np.float32)
        out[_outline(mask)] = rgb
    img = Image.fromarray(np.clip(np.round(out), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    size = max(2, round(min(image.shape[:2]) / 100))
    if box is not None:
        draw.rectangle([float(v) for v in box], outline=(0, 255, 0), width=size)
    if points is not None:
        for (x, y), label in zip(points, labels if labels is not None else np.ones(len(points))):
            fill = (0, 220, 0) if label == 1 else (230, 0, 0)
            r = 2 * size
            draw.ellipse([x - r, y - r, x + r, y + r], fill=fill, outline=(255, 255, 255), width=max(1, size // 2))
    return img


def _outline(mask: np.ndarray) -> np.ndarray:
    """Pixels of the mask with a 4-neighbour outside it (the image border counts as outside)."""
    inner = np.pad(mask, 1, constant_values=False)
    eroded = inner[1:-1, 1:-1] & inner[:-2, 1:-1] & inner[2:, 1:-1] & inner[1:-1, :-2] & inner[1:-1, 2:]
    return mask & ~eroded
