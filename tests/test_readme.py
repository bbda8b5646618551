"""The README's Quickstart holds exactly two commands, and CI runs the second verbatim.

The README and docs/*.md link only to files and headings that exist.
"""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path):
    return open(path, encoding="utf-8").read()


def _quickstart_commands():
    readme = _read(os.path.join(ROOT, "README.md"))
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def _anchor(heading):
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _pages():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def test_two_commands_and_ci_runs_the_test_command():
    install_and_train, install_and_test = _quickstart_commands()
    assert "python launch/local.py --config=experiments/configs/two_islands.py" in install_and_train
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert install_and_test in ci


def test_the_fast_inner_loop_leaves_out_slow_tests():
    assert 'python -m pytest -q -m "not slow" tests' in _read(os.path.join(ROOT, "README.md"))


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            file_part, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
            name = os.path.relpath(page, ROOT)
            if not os.path.exists(path):
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and path.endswith(".md") and anchor not in _anchors(path):
                broken.append(f"{name}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = _read(os.path.join(ROOT, "README.md"))
    pages = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    assert pages, "docs/ holds no pages"
    assert [p for p in pages if f"({p})" not in readme] == []


def test_every_page_and_section_a_config_names_exists():
    """What an experiment config's docstring or comments point to: `docs/PAGE.md` (with its `#anchor`), a
    `README.md#anchor`, or a README section by its title (`the README's "Title"`)."""
    readme = os.path.join(ROOT, "README.md")
    titles = set(re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", _read(readme), flags=re.S), flags=re.M))
    broken, named = [], 0
    for config in sorted(glob.glob(os.path.join(ROOT, "experiments", "configs", "*.py"))):
        text, name = _read(config), os.path.relpath(config, ROOT)
        for title in re.findall(r"README's \"([^\"]+)\"", text):
            named += 1
            if title not in titles:
                broken.append(f"{name}: the README has no section {title!r}")
        for page, anchor in re.findall(r"\b((?:docs/[\w-]+|README)\.md)(?:#([\w-]+))?", text):
            named += 1
            path = os.path.join(ROOT, page)
            if not os.path.exists(path):
                broken.append(f"{name}: {page} (no such file)")
            elif anchor and anchor not in _anchors(path):
                broken.append(f"{name}: {page}#{anchor} (no heading with that anchor)")
    assert named >= 4, f"only {named} references found: the patterns no longer match how configs cite the docs"
    assert not broken, "\n".join(broken)
