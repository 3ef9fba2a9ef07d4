"""Generation benchmark (issue "Inference engine", item 7): the engine vs transformers
generate vs the bandwidth bound on a Qwen3-0.6B-shaped random model, bf16, on one GPU.
Cases, protocol and the bound are described in `rlfuse/engine/benchmark.py`.

    OUT=./out python benchmarks/bench_generate.py                 # GPU, all cases + peer
    python benchmarks/bench_generate.py --small --no-peer         # CPU smoke test
    OUT=./out python benchmarks/bench_generate.py --shape 3.5-2b --cases decode   # Qwen3.5-2B shape, B=256
    python benchmarks/bench_generate.py --append-docs docs/benchmarks.md
Writes $OUT/bench_generate.json and $OUT/bench_generate.md; prints the table.
"""

import logging
import sys

from rlfuse.cli import main

if __name__ == "__main__":
    logging.basicConfig(level="INFO")
    sys.exit(main(["bench", "generate", *sys.argv[1:]]))
