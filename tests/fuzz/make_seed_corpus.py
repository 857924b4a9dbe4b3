#!/usr/bin/python3
"""Writes a seed corpus for the safetensors fuzzer: small valid files and typical breakages."""
import json
import os
import struct
import sys


def file_with_header(header, data_bytes):
    text = json.dumps(header) if not isinstance(header, str) else header
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + b"\x11" * data_bytes


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    seeds = {
        "valid": file_with_header({
            "__metadata__": {"format": "pt"},
            "gate": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]},
            "bias": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
            "packed": {"dtype": "U8", "shape": [2, 3], "data_offsets": [24, 30]}}, 30),
        "overlap": file_with_header({
            "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6),
        "size_mismatch": file_with_header({
            "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}}, 10),
        "past_end": file_with_header({
            "w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 5),
        "duplicate": file_with_header(
            '{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
            ' "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', 2),
        "empty_header": file_with_header("{}", 0),
        "truncated": file_with_header({"w": {"dtype": "U8", "shape": [4],
                                             "data_offsets": [0, 4]}}, 4)[:-3],
    }
    for name, blob in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(blob)


if __name__ == "__main__":
    main()
