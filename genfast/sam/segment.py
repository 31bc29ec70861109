"""`genfast segment INPUT`: an image (genfast/sam/commands.py) or a video or folder of frames
(genfast/sam/video_command.py)."""

from __future__ import annotations

import argparse


def segment(args: argparse.Namespace) -> int:
    from genfast.sam.commands import segment_command
    from genfast.sam.video_command import is_video, segment_video_command

    return segment_video_command(args) if is_video(args.image) else segment_command(args)
