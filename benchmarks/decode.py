"""Decode/prefill benchmark table (same as `exl2 bench`); run on a CUDA machine:

    python benchmarks/decode.py [--breakdown] [-m MODEL_DIR]
"""
import sys

from exl2.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
