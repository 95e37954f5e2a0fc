"""Reads the repository's Dockerfile: its stages' instructions, RUN commands, ENV and exec-form ENTRYPOINT/CMD,
so that tests run the image's own commands instead of copies of them that could drift."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


@dataclass
class Stage:
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def run_commands(self) -> list[str]:
        """Each RUN's shell commands, split at `&&` (one RUN may chain several)."""
        return [part.strip() for keyword, args in self.instructions if keyword == "RUN"
                for part in args.split(" && ")]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for keyword, args in self.instructions:
            if keyword == "ENV":
                for pair in shlex.split(args):
                    key, _, value = pair.partition("=")
                    values[key] = value
        return values

    def exec_form(self, keyword: str) -> list[str]:
        (args,) = [a for k, a in self.instructions if k == keyword]
        return json.loads(args)


def _logical_lines(text: str) -> list[str]:
    """Comments and parser directives dropped, `\\` continuations joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1].strip() + " "
            continue
        current += raw.strip()
        if current:
            lines.append(current)
        current = ""
    return lines


def stages(path: Path = DOCKERFILE) -> dict[str, Stage]:
    result: dict[str, Stage] = {}
    stage = Stage("")  # global ARGs before the first FROM
    for line in _logical_lines(path.read_text()):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.search(r"\bAS\s+(\S+)$", args, re.IGNORECASE)
            stage = result.setdefault(match.group(1) if match else str(len(result)), Stage(args))
            stage.name = match.group(1) if match else stage.name
        stage.instructions.append((keyword, args.strip()))
    return result


def global_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """ARGs declared before the first FROM, with their defaults."""
    values: dict[str, str] = {}
    for line in _logical_lines(path.read_text()):
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            break
        if keyword.upper() == "ARG":
            key, _, value = args.partition("=")
            values[key.strip()] = value.strip()
    return values
