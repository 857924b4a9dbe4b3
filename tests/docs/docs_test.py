#!/usr/bin/env python3
"""The documents are findable and true to the tree (docs/README.md, issue 39).

Checked over every Markdown file git tracks (node_modules and build trees are not tracked):
- every relative link resolves to a file or folder of the tree, and a link's #anchor to a
  heading of the page it names (GitHub's rule for heading ids);
- every path in the first column of a table (a layout or header table: `path`, `a/`, `b.h`)
  exists, relative to the page's folder or to the repository's root;
- every header (.h) of a folder that has a README.md is named in that README;
- every page of docs/ is listed in docs/README.md and in the top-level README's documents table;
- the top-level README stays a front door: at most 200 lines.
Run with the repository root as the first argument (ctest does).
"""
import fnmatch
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else ".")
LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
# A path in a table's first column: a folder (`a/`), a path with a folder, or a source file. A
# bare data-file name (`cluster.json`, `values.yaml`) may name what a program writes: not checked.
PATHLIKE = re.compile(r"^(?!-)([\w.\-]+/[\w.\-/]*|[\w.\-]+\.(h|cc|cu|py|sh|mjs|proto|cmake))$")


def tracked(pattern):
    """The files git tracks that match pattern; outside a git checkout, the tree's own files
    (build trees, node_modules and out/ left out)."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", pattern], check=True,
                             capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
        for top, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in (".git", "node_modules", "out")
                       and not d.startswith("build")]
            out += [os.path.relpath(os.path.join(top, f), ROOT) for f in files]
        out = [p for p in out if fnmatch.fnmatch(p, pattern)]
    return sorted(p for p in out if "node_modules" not in p)


def without_code(text):
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M)
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


class Docs(unittest.TestCase):
    def setUp(self):
        self.pages = tracked("*.md")
        self.assertIn("README.md", self.pages)
        self.assertIn("docs/README.md", self.pages)

    def test_every_relative_link_resolves(self):
        bad = []
        count = 0
        for page in self.pages:
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                text = without_code(f.read())
            for m in LINK.finditer(text):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z]+:", target):
                    continue  # http(s), mailto: not checked offline
                count += 1
                path, _, anchor = target.partition("#")
                where = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) \
                    if path else os.path.join(ROOT, page)
                if not where.startswith(ROOT) or not os.path.exists(where):
                    bad.append(f"{page}: ({target}) names nothing")
                elif anchor and where.endswith(".md") and anchor not in anchors(where):
                    bad.append(f"{page}: ({target}) names no heading of {os.path.relpath(where, ROOT)}")
        self.assertGreater(count, 50)
        self.assertEqual(bad, [])

    def test_every_path_in_a_table_exists(self):
        bad = []
        count = 0
        for page in self.pages:
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                lines = f.read().split("\n")
            for line in lines:
                if not line.startswith("| ") or line.startswith("|---"):
                    continue
                first = line.split("|")[1]
                for name in re.findall(r"`([^`]+)`", first):
                    if not PATHLIKE.match(name) or "*" in name:
                        continue
                    count += 1
                    here = os.path.join(ROOT, os.path.dirname(page), name)
                    if not (os.path.exists(here) or os.path.exists(os.path.join(ROOT, name))):
                        bad.append(f"{page}: `{name}` does not exist")
        self.assertGreater(count, 40)
        self.assertEqual(bad, [])

    def test_tables_are_whole_and_links_unbroken(self):
        # A formatter that took a page for code once split its tables and links (`](docs / x)`):
        # every line after a table row up to a blank line is a row, with as many cells as the
        # table's header, and no link's target holds a space.
        bad = []
        for page in self.pages:
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                lines = f.read().split("\n")
            in_fence, cells = False, None
            for n, line in enumerate(lines, 1):
                if line.startswith("```"):
                    in_fence = not in_fence
                if in_fence:
                    continue
                row = line.startswith("|") and line.rstrip().endswith("|")
                count = len(re.findall(r"(?<!\\)\|", re.sub(r"`[^`]*`", "", line))) - 1
                if cells is not None and line.strip() and not row:
                    bad.append(f"{page}:{n}: a line inside a table that is not a row")
                elif row and cells is not None and count != cells:
                    bad.append(f"{page}:{n}: {count} cells in a table of {cells}")
                cells = (cells if cells is not None else count) if row else None
                for target in re.findall(r"\]\(([^)]*)\)", without_code(line)):
                    if re.search(r"\s", target):
                        bad.append(f"{page}:{n}: link target '{target}' holds a space")
        self.assertEqual(bad, [])

    def test_every_folder_readme_names_its_headers(self):
        bad = []
        for page in self.pages:
            folder = os.path.dirname(page)
            if not folder or folder == "docs" or folder.startswith("tests"):
                continue
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                text = f.read()
            for header in tracked(f"{folder}/*.h"):
                rel = os.path.relpath(header, folder)
                if os.path.dirname(rel):
                    continue  # a subfolder's headers are its own README's, or named by folder
                if rel not in text:
                    bad.append(f"{page} does not name {rel}")
        self.assertEqual(bad, [])

    def test_every_page_is_in_both_indexes(self):
        with open(os.path.join(ROOT, "docs/README.md"), encoding="utf-8") as f:
            index = f.read()
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            front = f.read()
        for page in tracked("docs/*.md"):
            name = os.path.basename(page)
            if name == "README.md":
                continue
            self.assertIn(f"]({name})", index, f"docs/README.md does not list {name}")
            self.assertIn(f"](docs/{name})", front, f"README.md does not list {name}")

    def test_the_readme_is_a_front_door(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            lines = f.read().split("\n")
        self.assertLessEqual(len(lines), 200)
        # The two commands of the first lines, which .ci/run and users rely on.
        self.assertTrue(lines[2].startswith("    scripts/run.sh"), lines[2])
        self.assertTrue(lines[3].startswith("    scripts/test.sh"), lines[3])


if __name__ == "__main__":
    unittest.main(verbosity=2)
