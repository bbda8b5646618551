"""The README's Quickstart holds exactly two commands, and CI runs the second verbatim."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart_commands():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_two_commands_and_ci_runs_the_test_command():
    install_and_train, install_and_test = _quickstart_commands()
    assert "python launch/local.py --config=experiments/configs/two_islands.py" in install_and_train
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert install_and_test in ci
