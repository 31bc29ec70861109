"""`genfast bench sam`: the ladder the arguments name, SAM's (genfast/sam/bench.py) or SAM 2's
(genfast/sam/sam2/bench.py)."""

from __future__ import annotations

import argparse


def bench_command(args: argparse.Namespace) -> int:
    from genfast.bench.ladder import run
    from genfast.errors import UserError
    from genfast.sam.bench import SamAutomaticLadder, SamLadder
    from genfast.sam.sam2.bench import sam2_config, sam2_ladder

    if sam2_config(args) is not None:
        return run(sam2_ladder(args), args)
    if args.video:
        raise UserError("--video tracks with SAM 2: give --model sam2.1-hiera-tiny (or another SAM 2 model)")
    return run(SamAutomaticLadder() if args.automatic else SamLadder(), args)
