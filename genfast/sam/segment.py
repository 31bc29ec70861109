"""`genfast segment INPUT`: an image (genfast/sam/commands.py), a video or a folder of its frames
(genfast/sam/video_command.py), or many images: a glob pattern or a folder of them
(genfast/sam/batch_command.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal


def input_kind(args: argparse.Namespace) -> Literal["image", "video", "images"]:
    """What INPUT is: one image file; a video file or a folder of numbered frames (or any, with
    --video); or many images (a glob pattern, another folder, or a folder with --images). The
    --ray path asks too: it takes many images only."""
    from genfast.errors import UserError
    from genfast.sam.batch_command import is_frame_folder, is_glob
    from genfast.sam.video_command import VIDEO_SUFFIXES

    if args.images and args.video:
        raise UserError("give --images or --video, not both")
    source = Path(args.image).expanduser()
    if is_glob(args.image) and not source.exists():
        if args.video:
            raise UserError("--video takes a video file or a folder of frames, not a glob pattern")
        return "images"
    if source.is_dir():
        return "video" if args.video or (not args.images and is_frame_folder(source)) else "images"
    if args.images:
        raise UserError(f"--images is for a folder or a glob pattern; {args.image} is a file")
    return "video" if args.video or source.suffix.lower() in VIDEO_SUFFIXES else "image"


def segment(args: argparse.Namespace) -> int:
    from genfast.sam.batch_command import segment_images_command
    from genfast.sam.commands import segment_command
    from genfast.sam.video_command import segment_video_command

    command = {"image": segment_command, "video": segment_video_command, "images": segment_images_command}
    return command[input_kind(args)](args)
