"""Image files: reading any Pillow image as RGB, PNG encoding with text metadata, and writing
several output files atomically, all or nothing.

Outputs are encoded in memory first, then staged as temp files beside their targets and renamed
into place together: an error never leaves a partial (or half the set of) output files, and an
existing file is never replaced without `force`.
"""

from __future__ import annotations

import glob
import io
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, PngImagePlugin, UnidentifiedImageError

from genfast.errors import UserError
from genfast.storage.files import check_outputs, make_public


def load_image(path: str | Path) -> np.ndarray:
    """An image file as HxWx3 uint8 RGB, its EXIF orientation applied (first frame of animations;
    alpha dropped; grayscale, palette, CMYK and 16-bit images converted)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"image {str(path)!r} does not exist (or is not a file)")
    try:
        with Image.open(path) as img:
            img.load()
            img = ImageOps.exif_transpose(img)
            return _to_rgb(img)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:
        raise UserError(
            f"cannot read {str(path)!r} as an image (Pillow: {e}); give a PNG, JPEG, "
            "WebP or another format Pillow reads"
        ) from e


def _to_rgb(img: Image.Image) -> np.ndarray:
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):  # 16/32-bit grayscale: scale to 8 bits
        values = np.asarray(img, dtype=np.float64)
        top = (
            1.0
            if img.mode == "F" and values.max(initial=0) <= 1
            else 255.0
            if values.max(initial=0) <= 255
            else 65535.0
        )
        gray = np.clip(np.round(values * (255.0 / top)), 0, 255).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()


def png_bytes(img: Image.Image, text: Mapping[str, str]) -> bytes:
    """PNG-encode `img` with `text` as tEXt metadata chunks."""
    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    buf = io.BytesIO()
    img.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def check_png_names(paths: Sequence[Path]) -> None:
    """Images are written as PNG (lossless masks, the settings as metadata): refuse a name that
    claims another format, which would hold PNG bytes under a .jpg or .webp name."""
    for path in paths:
        if path.suffix and path.suffix.lower() != ".png":
            raise UserError(f"{path}: genfast writes images as PNG; name it {path.with_suffix('.png')}")


def _staging_pattern(path: Path) -> str:
    # mkstemp's names: the prefix, eight random characters, the suffix (see write_files).
    return f".{glob.escape(path.name)}.{'?' * 8}.tmp"


def remove_stale_staging(paths: Iterable[Path]) -> None:
    """Remove the temp files a killed run (SIGKILL, power loss) left beside these outputs: a batch
    command calls this for the outputs it is about to write again, so a resumed run leaves none."""
    for path in paths:
        for stale in path.parent.glob(_staging_pattern(path)):
            stale.unlink(missing_ok=True)


def write_files(files: Mapping[Path, bytes], force: bool) -> None:
    """Write every file atomically, all or nothing: each goes to a temp file beside its target,
    and only when all are staged are they renamed into place. Should a rename fail, the files
    this call created are removed again (replaced ones, with --force, stay replaced)."""
    check_outputs(list(files), force)
    staged: list[tuple[str, Path]] = []
    created: list[Path] = []
    try:
        for path, data in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # _staging_pattern
            staged.append((tmp, path))
            make_public(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        for tmp, path in staged:
            existed = path.exists()
            os.replace(tmp, path)
            if not existed:
                created.append(path)
    except BaseException as e:
        failed = path  # the output being staged or renamed
        for done in created:
            done.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(f"cannot write {failed}: {e.strerror or e}") from e
        raise
    finally:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
