#!/usr/bin/env python
"""Write a synthetic GGUF model: the same code and options as `hybrid make-model`.

    python tools/make_model.py OUT.gguf --arch qwen35 --preset 27b --type Q4_K_M
"""
import sys

from hybrid.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["make-model"]
    main()
