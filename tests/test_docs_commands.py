"""Documentation as tests (issue 23): every code block that README.md and docs/ tell a user to run is run here.

Every page is collected (``README.md`` and ``docs/**/*.md``, new pages included), and every fenced block in it is
one of:

* **run**: ``bash`` blocks run in a scratch copy of the checkout with this environment's ``bin`` first on ``PATH``
  (``python``, ``tfdebug``); ``python`` blocks run in one subprocess, each in a fresh namespace; ``yaml`` blocks are
  LightningCLI configs, parsed and instantiated by a real ``LightningCLI`` (the Trainer and every callback built,
  with the demo model and data).
* **output**: a block with no language, ``text`` or ``json`` is what a command prints, not something to run (a block
  without a language that starts like a command fails the test: give it a language).
* **marked** with an HTML comment right before the fence (invisible on the rendered page):
  ``<!-- docs-test: skip (why) -->`` illustration only, not run (the reason is required: a network, a path of the
  reader's own run, a recursive test run, a GPU); ``<!-- docs-test: slow -->`` run only under ``pytest -m slow``;
  ``<!-- docs-test: setup (code) -->`` a python block runs after ``code`` (the names the page takes from the block
  before, or a model to fit); ``<!-- docs-test: exit N (why) -->`` a bash block's expected exit status (default 0);
  ``<!-- docs-test: install -->`` a bash block of install lines (``pip install .``), run as printed under
  ``pytest -m slow`` by ``tests/test_packaging.py``, in a fresh virtual environment outside the checkout. Every
  ``pip`` line a page prints is in such a block: none is skipped.

Short-run overrides, the only change made to what the docs say: a command running ``examples/train.py fit`` gets
``--trainer.max_steps 20`` appended unless it sets ``--trainer.max_steps`` itself or is a ``tfdebug check`` line
(which sets its own); python blocks run with ``PL_TRAINER_MAX_STEPS=4`` and ``PL_TRAINER_LIMIT_VAL_BATCHES=2``
(Lightning's own environment defaults for ``Trainer`` arguments). ``test_docs_blocks_are_counted`` prints how many
blocks run (by default and under ``-m slow``), how many are skipped and how many are output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = {"bash", "sh", "shell", "python", "py", "yaml", "yml"}
OUTPUT = {"", "text", "json"}
COMMAND_WORDS = ("python ", "tfdebug ", "bash ", "pip ", "pytest ", ".venv/", "$ ", "mkdocs ", "ruff ")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(skip|slow|setup|exit|install)\b\s*(\d+)?\s*(?:\((.*)\))?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
SHORT_RUN = "--trainer.max_steps 20"


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    slow: bool = False
    install: bool = False
    setup: str = ""
    exit: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        if self.lang in OUTPUT:
            return "output"
        if self.skip is not None:
            return "skip"
        if self.install:
            return "install"
        return "slow" if self.slow else "run"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(path: Path) -> list[Block]:
    """The fenced blocks of one page, with the markers on the lines right above each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, lang = opened.group(1), opened.group(2).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        block = Block(str(path.relative_to(ROOT)), start + 1, lang, "\n".join(body) + "\n")
        above = start - 1
        while above >= 0 and lines[above].strip().startswith("<!--"):
            marker = MARKER.match(lines[above])
            if not marker:
                if "docs-test" in lines[above]:
                    block.errors.append(f"unreadable marker {lines[above].strip()!r}")
                break
            kind, number, text = marker.groups()
            if kind == "skip":
                if not (text or "").strip():
                    block.errors.append("`docs-test: skip` needs a reason: <!-- docs-test: skip (why) -->")
                block.skip = (text or "").strip()
            elif kind == "slow":
                block.slow = True
            elif kind == "install":
                block.install = True
            elif kind == "setup":
                block.setup = text or ""
            elif number is None:
                block.errors.append("`docs-test: exit` needs a status: <!-- docs-test: exit 1 (why) -->")
            else:
                block.exit = int(number)
            above -= 1
        blocks.append(block)
        i += 1
    return blocks


BLOCKS = [b for p in pages() for b in parse(p)]


def _by(kind: str, langs: set[str]) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind and b.lang in langs]


def test_every_block_is_run_output_or_marked_with_a_reason():
    problems = [f"{b.id}: {e}" for b in BLOCKS for e in b.errors]
    for b in BLOCKS:
        if b.lang not in RUN | OUTPUT:
            problems.append(f"{b.id}: fence language {b.lang!r}: use bash, python, yaml, or text for output")
        first = b.code.lstrip().splitlines()[0] if b.code.strip() else ""
        if b.lang == "" and first.startswith(COMMAND_WORDS):
            problems.append(f"{b.id}: a command in a block without a language; mark it ```bash so that it runs")
        if b.setup and b.lang not in ("python", "py"):
            problems.append(f"{b.id}: `docs-test: setup` is for python blocks")
        if b.install and b.lang not in ("bash", "sh", "shell"):
            problems.append(f"{b.id}: `docs-test: install` is for bash blocks")
    assert not problems, "\n".join(problems)


def test_docs_blocks_are_counted(capsys):
    counts = {k: sum(b.kind == k for b in BLOCKS) for k in ("run", "slow", "install", "skip", "output")}
    assert counts["run"] >= 20  # the collector finds the callback pages' snippets, the README's, the CLI pages'
    langs = {lang: sum(b.kind == "run" and b.lang == lang for b in BLOCKS) for lang in ("bash", "python", "yaml")}
    with capsys.disabled():
        print(
            f"\ndocs blocks in {len(pages())} pages: {counts['run']} run by default ({langs['bash']} bash, "
            f"{langs['python']} python, {langs['yaml']} yaml), {counts['slow']} under -m slow, "
            f"{counts['install']} install blocks (under -m slow, in a fresh venv: tests/test_packaging.py), "
            f"{counts['skip']} skipped (illustration, marked with why), {counts['output']} output"
        )


# ------------------------------------------------------------------ python and yaml blocks: one subprocess

_RUNNER = textwrap.dedent(
    """
    import json, os, sys, tempfile, traceback, warnings
    blocks = json.load(open(sys.argv[1]))
    results = {}
    for block in blocks:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if block["lang"] in ("python", "py"):
                    namespace = {"__name__": "__docs__"}
                    exec(compile(block["setup"], block["id"] + " (setup)", "exec"), namespace)
                    exec(compile(block["code"], block["id"], "exec"), namespace)
                else:
                    from lightning.pytorch.cli import LightningCLI
                    from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
                    path = os.path.join(tempfile.mkdtemp(), "config.yaml")
                    with open(path, "w") as f:
                        f.write(block["code"])
                    cli = LightningCLI(
                        TinyGPT, TinyTextDataModule, args=["--config", path], run=False, save_config_callback=None
                    )
                    names = [type(cb).__name__ for cb in cli.trainer.callbacks]
                    for wanted in block["classes"]:
                        assert wanted in names, f"{wanted} not among the Trainer's callbacks {names}"
            results[block["id"]] = None
        except BaseException:
            results[block["id"]] = traceback.format_exc(limit=-3)
    json.dump(results, open(sys.argv[2], "w"))
    """
)


def _sandbox(tmp_path: Path) -> Path:
    """A scratch copy of the checkout's files (what git would ship), so runs/ and reports land outside it."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    dest = tmp_path / "checkout"
    for rel in listed:
        src = ROOT / rel
        if src.is_file() and not rel.startswith(("docs/", "tests/")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_TRAINER_")}
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _yaml_classes(code: str) -> list[str]:
    return [path.rsplit(".", 1)[-1] for path in re.findall(r"class_path:\s*([\w.]+)", code)]


def test_python_and_yaml_blocks_run(tmp_path):
    import yaml

    blocks = [b for b in BLOCKS if b.kind == "run" and b.lang in ("python", "py", "yaml", "yml")]
    payload = []
    for b in blocks:
        if b.lang in ("yaml", "yml"):
            config = yaml.safe_load(b.code)
            assert isinstance(config, dict) and set(config) <= {"trainer", "model", "data", "seed_everything"}, (
                f"{b.id}: a yaml block is a LightningCLI config (trainer/model/data); mark anything else "
                "<!-- docs-test: skip (why) -->"
            )
        payload.append({"id": b.id, "lang": b.lang, "code": b.code, "setup": b.setup, "classes": _yaml_classes(b.code)})
    (tmp_path / "blocks.json").write_text(json.dumps(payload))
    (tmp_path / "runner.py").write_text(_RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    env = {**_env(), "PL_TRAINER_MAX_STEPS": "4", "PL_TRAINER_LIMIT_VAL_BATCHES": "2"}
    env["PL_TRAINER_ENABLE_PROGRESS_BAR"] = "0"
    done = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json"), str(tmp_path / "results.json")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    failed = {k: v for k, v in results.items() if v is not None}
    assert set(results) == {b.id for b in blocks}
    assert not failed, "\n\n".join(f"{k} failed:\n{v}" for k, v in failed.items())


# ------------------------------------------------------------------ bash blocks: each in a scratch checkout


def commands(code: str) -> list[str]:
    """The block's commands, continuation lines joined, with the short-run override where it applies."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if not command or command.startswith("#"):
            continue
        if (
            "examples/train.py fit" in command
            and "--trainer.max_steps" not in command
            and "tfdebug check" not in command
        ):
            command = f"{command} {SHORT_RUN}"
        out.append(command)
    return out


def _run_bash(block: Block, tmp_path: Path) -> None:
    checkout = _sandbox(tmp_path)
    script = "set -e\n" + "\n".join(commands(block.code)) + "\n"
    done = subprocess.run(["bash", "-c", script], cwd=checkout, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == block.exit, (
        f"{block.id}: exit status {done.returncode}, expected {block.exit}\n{script}\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", _by("run", {"bash", "sh", "shell"}), ids=lambda b: b.id)
def test_bash_block_runs(block, tmp_path):
    _run_bash(block, tmp_path)


@pytest.mark.slow
@pytest.mark.ci  # CI's main lane runs the slow blocks (a preflight, a demo run) beside the matrices
@pytest.mark.parametrize("block", _by("slow", {"bash", "sh", "shell"}), ids=lambda b: b.id)
def test_slow_bash_block_runs(block, tmp_path):
    _run_bash(block, tmp_path)


@pytest.mark.slow
def test_slow_python_and_yaml_blocks_are_none():
    """Slow python/yaml blocks would need a runner of their own; none is needed yet."""
    assert not [b.id for b in BLOCKS if b.kind == "slow" and b.lang not in ("bash", "sh", "shell")]


def test_the_short_run_override_leaves_the_readme_preflight_line_as_written():
    readme = next(b for b in BLOCKS if b.page == "README.md" and "tfdebug check" in b.code)
    assert readme.kind == "slow"  # the README's preflight line runs as written in CI's main lane (-m "slow and ci")
    assert commands(readme.code)[0] == "tfdebug check -- python examples/train.py fit --config examples/demo.yaml"
    assert commands("python examples/train.py fit --config x.yaml --model.lr 1e-5   # row 11\n") == [
        f"python examples/train.py fit --config x.yaml --model.lr 1e-5 {SHORT_RUN}"
    ]


def test_the_contributors_routine_runs_the_readme_preflight_line_as_printed():
    readme = next(b for b in BLOCKS if b.page == "README.md" and "tfdebug check" in b.code)
    line = commands(readme.code)[0]
    routine = (ROOT / "docs" / "contributing.md").read_text().split("## Before you stop", 1)
    assert len(routine) == 2, "docs/contributing.md has no `## Before you stop` section"
    assert line in routine[1].split("\n## ", 1)[0], f"the before-stop routine does not run `{line}` as printed"


# ------------------------------------------------------------------ install lines: run, and none from the index yet

PIP_LINE = re.compile(r"^(python3? -m )?pip3? (install|wheel|download)\b")
PUBLISHED = re.compile(r"pip3? install\s+['\"]?lightning-tfdebug\b")  # the package index's name, not published yet


def test_every_pip_line_is_in_an_install_block_and_the_unpublished_name_only_in_the_once_released_note():
    """The install lines the pages print are run (tests/test_packaging.py runs each install block, ``-m slow``);
    ``pip install lightning-tfdebug`` fails until a release is published, so it is printed at most once, in the note
    marked "Once released", and never in a block, the package's messages included."""
    problems = []
    for b in BLOCKS:
        pip_lines = [c for c in commands(b.code) if PIP_LINE.match(c)]
        if b.lang in ("bash", "sh", "shell") and pip_lines and b.kind != "install":
            problems.append(f"{b.id}: {pip_lines[0]!r} is not in a block marked <!-- docs-test: install -->")
        if PUBLISHED.search(b.code):
            problems.append(f"{b.id}: a block installs `lightning-tfdebug` from the package index")
    for page in ("README.md", "docs/installation.md"):
        if not any(b.page == page and b.kind == "install" for b in BLOCKS):
            problems.append(f"{page} has no install block")
    texts = [*pages(), *sorted((ROOT / "lightning_tfdebug").rglob("*.py"))]
    named = [(p, line) for p in texts for line in p.read_text().splitlines() if PUBLISHED.search(line)]
    problems += [f"{p.relative_to(ROOT)}: {line.strip()!r}" for p, line in named if "once released" not in line.lower()]
    if len(named) > 1:
        problems.append(f"`pip install lightning-tfdebug` is printed {len(named)} times; one 'Once released' note")
    assert not problems, "\n".join(problems)
