"""Serving benchmark: `nanoserve bench serve` (nanoserve/bench/serving.py), kept here for old
commands; the flags and the output files are the same.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --dataset random \\
        --random-input-len 1024 --random-output-len 256 --num-prompts 200 --request-rate 4,8,inf
"""

import sys

from nanoserve.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
