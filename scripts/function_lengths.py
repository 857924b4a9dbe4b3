#!/usr/bin/env python3
"""Counts the lines of every top-level function body in the C++ and CUDA files git tracks
(brace matching outside comments, strings and namespace braces; functions defined inside a class
body are not counted). Prints how many reach 60 and 100 lines, outside the tests and in them,
and the longest ones.

    scripts/function_lengths.py [--top N]
"""
import argparse
import os
import re
import subprocess


def functions(root, path):
    with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    depth, start, name = 0, None, None
    for i, line in enumerate(lines):
        code = re.sub(r"//.*", "", line)
        code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
        code = re.sub(r"'(\\.|[^'\\])*'", "''", code)
        if re.match(r"^\s*namespace\b.*\{\s*$", code) or re.match(r"^\s*\}\s*//\s*namespace", line):
            continue
        opened, closed = code.count("{"), code.count("}")
        if (depth == 0 and opened > closed and not code.strip().startswith("}")
                and not re.match(r"^\s*(class|struct|enum|union)\b", code)
                and ("(" in code or (i > 0 and ")" in lines[i - 1]))):
            start = i
            j = i
            while j > 0 and "(" not in lines[j]:
                j -= 1
            name = lines[j].strip()[:90]
        depth = max(0, depth + opened - closed)
        if depth == 0 and start is not None:
            yield i - start + 1, start + 1, name
            start = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                          capture_output=True, text=True).stdout.strip()
    files = subprocess.run(["git", "-C", root, "ls-files", "*.cc", "*.cu"], check=True,
                           capture_output=True, text=True).stdout.split()
    found = [(n, f, line, name) for f in files for n, line, name in functions(root, f)]
    found.sort(reverse=True)
    for label, rows in (("outside tests", [r for r in found if not r[1].startswith("tests/")]),
                        ("tests", [r for r in found if r[1].startswith("tests/")])):
        print(f"{label}: {sum(r[0] >= 60 for r in rows)} functions of >= 60 lines, "
              f"{sum(r[0] >= 100 for r in rows)} of >= 100")
        for n, f, line, name in rows[:args.top]:
            print(f"  {n:4d}  {f}:{line}  {name}")


if __name__ == "__main__":
    main()
