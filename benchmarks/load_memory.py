"""Peak memory of loading an LLM as `genfast generate` loads it (`genfast.llm.session.load`).

    python benchmarks/load_memory.py --model DIR [--quant int8|int4] [--tp N] [--dtype bfloat16]

Prints, per rank, the anonymous resident memory (RssAnon: the process's own allocations, not the
memory-mapped checkpoint pages, which the page cache shares between ranks) before loading, after
loading, and at its peak during the load (sampled every 5 ms by a thread of the process). With
`--tp N` the script runs itself as N ranks under torch.distributed.run. Linux only. To compare two
versions of genfast in one session, run it with PYTHONPATH pointing at each checkout.
"""

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def rss_anon_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler(threading.Thread):
    def __init__(self, period_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.period_s, self.peak = period_s, 0.0

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_anon_gib())
            time.sleep(self.period_s)


def measure(args: argparse.Namespace) -> None:
    sampler = PeakSampler()
    sampler.start()
    import genfast
    from genfast.llm.session import load
    from genfast.llm.tensor_parallel import current_rank, join

    if args.tp > 1:
        join(args.tp)
    before = rss_anon_gib()
    loaded = load(args.model, "cpu", args.dtype, quant=args.quant, tp=args.tp)
    time.sleep(0.05)  # one more sample
    if current_rank() == 0:
        print(
            f"genfast from {Path(genfast.__file__).parent.parent} | {args.model} | {loaded.dtype} "
            f"quant={loaded.quant} tp={args.tp} | {os.cpu_count()} CPUs",
            flush=True,
        )
    time.sleep(0.1 * current_rank())  # ranks print in order
    print(
        f"rank {current_rank()}: RssAnon before load {before:.2f} GiB, after {rss_anon_gib():.2f} GiB, "
        f"peak {sampler.peak:.2f} GiB",
        file=sys.stderr,
        flush=True,
    )  # other ranks' stdout is silenced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="none")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.tp > 1 and "RANK" not in os.environ:
        run = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.tp}",
            __file__,
            *sys.argv[1:],
        ]
        sys.exit(subprocess.run(run, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)
    measure(args)


if __name__ == "__main__":
    main()
