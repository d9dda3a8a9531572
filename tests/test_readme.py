"""The README opens with the two commands CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_commands_are_the_ci_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None and readme.index("```bash") < 200, "README must open with the commands"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci == commands
