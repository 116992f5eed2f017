"""The numpy float64 reference forward (qwen35_ref) against llama.cpp on the small trained model.

This validates the oracle itself, so the engine's whole-model tests can trust it. llama.cpp rounds
activations to 8 bits before each quantised product; on this model that moves logits (scale ~20)
by ~0.15 on Q8_0 and ~0.3 on Q4_K_M (measured), hence the bounds below and the margin rule for
argmax comparisons. Tests needing llama.cpp skip without it; the MTP agreement test does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.reference.llama_cpp_ref import (
    llama_cpp_greedy,
    llama_cpp_logits,
    llama_cpp_mtp_run,
    llama_cpp_tokenize,
    margin_mismatches,
    require_llama_cpp,
)
from tests.reference.qwen35_ref import reference_hidden, reference_logits, reference_mtp_logits

# model fixture name -> (max |logit difference| allowed, margin-rule tolerance); ~2.5x measured
BOUNDS = {
    "trained_model_q8": (0.4, 0.5),
    "trained_model_q4km": (0.8, 1.0),
}

CODE_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import argparse\n\n\ndef parse_args():\n    parser = argparse.ArgumentParser(description=",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n",
]

# Fresh code (not from the training set) for the MTP agreement test, and its token ids from
# llama.cpp's tokenizer, stored so that test runs without llama.cpp (checked below when present).
LONG_CODE = '''import os
import sys


def read_lines(path):
    """Return the lines of a text file without trailing newlines."""
    with open(path, "r", encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda item: item[1], reverse=True)
        return items[:n]


def main(argv):
    if len(argv) < 2:
        print("usage: count.py FILE")
        return 1
    counter = Counter()
    for line in read_lines(argv[1]):
        for word in line.split():
            counter.add(word)
    for word, count in counter.most_common(10):
        print(word, count)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''
LONG_CODE_IDS = [
    797, 1020, 198, 797, 1130, 611, 318, 1906, 3269, 2488, 323, 258, 419, 1958, 308, 2641, 385, 270,
    1533, 760, 2730, 6598, 908, 1350, 1471, 258, 501, 2316, 2488, 11, 284, 81, 453, 2533, 844, 2676,
    12, 23, 1114, 357, 1629, 279, 259, 355, 370, 628, 1359, 3506, 6180, 77, 1114, 359, 1115, 302,
    1629, 2906, 532, 1728, 3136, 279, 258, 351, 661, 867, 753, 287, 323, 259, 310, 6570, 82, 272,
    4437, 258, 351, 1187, 376, 11, 799, 323, 259, 310, 6570, 82, 3722, 60, 272, 310, 6570, 82, 668,
    2894, 11, 220, 15, 8, 420, 220, 16, 290, 258, 351, 4373, 601, 3881, 376, 11, 293, 323, 259,
    2715, 272, 2466, 376, 6570, 82, 1841, 1225, 799, 5362, 1995, 25, 1995, 58, 16, 531, 5287, 830,
    271, 259, 355, 2715, 1391, 77, 2906, 318, 4090, 2683, 85, 323, 258, 335, 781, 2683, 85, 8, 696,
    220, 17, 279, 259, 1591, 474, 484, 578, 25, 2814, 1999, 475, 3739, 602, 259, 355, 220, 16, 198,
    258, 6928, 272, 1728, 3136, 527, 258, 359, 1115, 302, 1906, 3269, 2683, 85, 58, 16, 3730, 259,
    359, 7083, 302, 1115, 2619, 761, 276, 6928, 1153, 7, 1060, 271, 258, 359, 7083, 11, 2814, 302,
    6928, 13, 2298, 601, 3881, 7, 16, 15, 323, 259, 1591, 7, 1060, 11, 2814, 271, 258, 355, 220, 15,
    611, 852, 661, 383, 358, 411, 3405, 894, 358, 1482, 258, 1130, 8133, 7, 894, 4540, 8115, 529,
]  # fmt: skip


@pytest.fixture(params=sorted(BOUNDS))
def model(request):
    """(model path, max abs bound, margin tolerance) for each GGUF of the trained model."""
    max_abs, margin_tol = BOUNDS[request.param]
    return request.getfixturevalue(request.param), max_abs, margin_tol


def test_margin_rule_counts_only_confident_flips():
    ref = np.array([[5.0, 1.0, 0.0], [2.0, 1.9, 0.0], [0.0, 3.0, 1.0], [4.0, 0.0, 1.0]])
    ours = np.array([[1.0, 5.0, 0.0], [1.9, 2.0, 0.0], [0.0, 3.0, 1.0], [4.0, 0.0, 1.0]])
    assert margin_mismatches(ref, ours, tol=0.5) == 1  # row 0 flips with gap 4; row 1's gap is 0.1
    assert margin_mismatches(ref, ours, tol=5.0) == 0
    with pytest.raises(ValueError):
        margin_mismatches(ref, ours[:2], tol=0.5)


def test_reference_logits_match_llama_cpp(model):
    path, max_abs, margin_tol = model
    require_llama_cpp()
    for text in CODE_PROMPTS:
        ids = llama_cpp_tokenize(path, text)
        ours, theirs = reference_logits(path, ids), llama_cpp_logits(path, ids)
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() < max_abs, text
        assert margin_mismatches(ours, theirs, margin_tol) == 0, text


def test_llama_cpp_greedy_continuation_matches_reference_argmax(model):
    path, _, margin_tol = model
    require_llama_cpp()
    for text in CODE_PROMPTS[:2]:
        prompt = llama_cpp_tokenize(path, text)
        new_ids, their_rows = llama_cpp_greedy(path, prompt, 32)
        # teacher-forced reference over prompt + continuation: row i predicts token i+1
        ours = reference_logits(path, prompt + new_ids)[len(prompt) - 1 : -1]
        assert margin_mismatches(ours, their_rows, margin_tol) == 0, text


def test_reference_mtp_head_matches_llama_cpp(model):
    path, max_abs, margin_tol = model
    require_llama_cpp()
    ids = LONG_CODE_IDS
    theirs = llama_cpp_mtp_run(path, ids)
    assert np.abs(reference_hidden(path, ids) - theirs.hidden).max() < max_abs
    assert np.abs(reference_logits(path, ids) - theirs.logits).max() < max_abs
    ours_mtp = reference_mtp_logits(path, ids)
    assert np.abs(ours_mtp - theirs.mtp_logits).max() < max_abs
    assert margin_mismatches(ours_mtp, theirs.mtp_logits, margin_tol) == 0


def test_mtp_head_agrees_with_main_head_on_code(model):
    """MTP row p (x_p, h_{p-1}) drafts x_{p+1}, as does the main head's row p (models/README.md:
    ~0.8 teacher-forced agreement on held-out code; this text measures 0.80)."""
    path, _, _ = model
    main_argmax = reference_logits(path, LONG_CODE_IDS).argmax(axis=1)
    mtp_argmax = reference_mtp_logits(path, LONG_CODE_IDS).argmax(axis=1)
    agreement = np.mean(mtp_argmax == main_argmax)
    assert agreement > 0.6
    # row p drafts x_{p+1}, not x_{p+2}: against the main head's row p+1 it agrees only by chance
    assert np.mean(mtp_argmax[:-1] == main_argmax[1:]) < 0.3


def test_long_code_ids_are_llama_cpp_tokenization(trained_model_q4km):
    require_llama_cpp()
    assert llama_cpp_tokenize(trained_model_q4km, LONG_CODE) == LONG_CODE_IDS
