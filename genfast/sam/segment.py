"""`genfast segment INPUT`: an image (genfast/sam/commands.py), a video or a folder of its frames
(genfast/sam/video_command.py), or many images: a glob pattern or a folder of them
(genfast/sam/batch_command.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def segment(args: argparse.Namespace) -> int:
    from genfast.errors import UserError
    from genfast.sam.batch_command import is_frame_folder, is_glob, segment_images_command
    from genfast.sam.commands import segment_command
    from genfast.sam.video_command import VIDEO_SUFFIXES, segment_video_command

    if args.images and args.video:
        raise UserError("give --images or --video, not both")
    source = Path(args.image).expanduser()
    if is_glob(args.image) and not source.exists():
        if args.video:
            raise UserError("--video takes a video file or a folder of frames, not a glob pattern")
        return segment_images_command(args)
    if source.is_dir():
        if args.video or (not args.images and is_frame_folder(source)):
            return segment_video_command(args)
        return segment_images_command(args)
    if args.images:
        raise UserError(f"--images is for a folder or a glob pattern; {args.image} is a file")
    if args.video or source.suffix.lower() in VIDEO_SUFFIXES:
        return segment_video_command(args)
    return segment_command(args)
