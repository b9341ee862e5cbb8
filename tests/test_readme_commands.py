"""Every command the README and the pages in docs/ show runs as written: each `polytrain ...` command in their code
blocks (shell blocks, and the `$ ` lines of console ones) runs in a temporary folder, shortened where it trains by
flags appended to it:
`--max-steps 2`; verify `--steps 2`; bench 2 steps on at most 2 devices at the smallest batch and, unless it
names strategies, data parallelism only (each strategy's row starts its workers again). A run folder a page
names (`runs/20261122-224501`) is the first run that the commands before it wrote. Commands that need another
launcher (torchrun on two machines, srun) are tested elsewhere and only listed here. The pages that record
measurements (`RECORDS`: docs/benchmarks.md, docs/install-size.md) are left out: their commands are the
measurements themselves, minutes each, run by hand.

The commands run in order (the README's, then each page's, pages sorted by path) through `polytrain.cli.main`
(what the `polytrain` script runs), one Python process for the one-process commands and one for those that
start workers (marked `multiprocess`), so torch is imported twice, not once per command; each distinct command
runs once. The checks of what a page says (the README's sample output, the list of what --resume may change in
docs/reliability.md) are at the end.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest
from processes import ENV, finish

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RECORDS = {"benchmarks.md", "install-size.md"}  # measurements, run by hand (see above)
CONSOLE_BLOCKS = {"text", "console"}  # output with `$ ` before each command
SKIPPED_BLOCKS = {"python", "py", "toml", "json", "yaml", "ini"}
ELSEWHERE = {
    "torchrun": "runs on several machines; test_multinode.py runs it on 127.0.0.1",
    "srun": "needs a SLURM allocation; test_slurm.py and test_slurm_launch.py run it",
}
RUN = "@RUN@"  # the first run folder the commands before it wrote
OPERATORS = {"&&", "||", ";", "|", "&"}


class Command(NamedTuple):
    written: str  # as the page writes it
    argv: Optional[tuple]  # what runs (None: another launcher, `launcher` says which)
    launcher: str = ""
    page: str = "README.md"  # where it is written, relative to the repository


def pages() -> List[Path]:
    """The README, then every page under docs/ but the records, sorted by path."""
    return [README] + sorted(path for path in DOCS.rglob("*.md") if path.name not in RECORDS)


def page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def shell_lines(text: str):
    """(language of the block, one logical line) for every line of a page's fenced code blocks, with
    backslash continuations joined."""
    for language, body in re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        if language.lower() in SKIPPED_BLOCKS:
            continue
        pending = ""
        for line in body.splitlines():
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            yield language.lower(), pending + line
            pending = ""


def readme_commands(text: str, page: str = "README.md") -> List[Command]:
    """The commands a page's code blocks show, in order."""
    found = []
    for language, line in shell_lines(text):
        line = line.strip()
        if language in CONSOLE_BLOCKS:
            if not line.startswith("$ "):
                continue  # what a command printed
            line = line[2:]
        if line.startswith("#") or not re.search(r"(^|[\s;&|])polytrain(\s|$)", line):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = list(lexer)
        except ValueError as error:
            raise ValueError(f"{page}: {line!r} does not read as a shell command ({error})") from None
        segment: list = []
        for token in tokens + [";"]:
            if token not in OPERATORS:
                segment.append(token)
                continue
            command = as_command(segment)
            if command is not None:
                found.append(command._replace(page=page))
            segment = []
    return found


def as_command(tokens: list) -> Optional[Command]:
    if "polytrain" not in tokens:
        return None
    written = shlex.join(tokens)
    if tokens[0] == "polytrain":
        return Command(written, tuple(tokens[1:]))
    if tokens[:3] == [Path(tokens[0]).name, "-m", "polytrain"] and tokens[0].startswith("python"):
        return Command(written, tuple(tokens[3:]))
    return Command(written, None, tokens[0])


def value(argv: list, flag: str) -> Optional[str]:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def with_value(argv: list, flag: str, new: str) -> list:
    """`argv` with `flag` set to `new` (appended where it was not given)."""
    if flag in argv[:-1]:
        at = argv.index(flag)
        return argv[: at + 1] + [new] + argv[at + 2 :]
    return argv + [flag, new]


def run_folder(argument: str) -> str:
    """A run folder as a page writes it (a time stamp of its own example) stands for the first run the
    commands before it wrote; `runs/LATEST` and others are kept."""
    return RUN if re.fullmatch(r"(\./)?runs/\d{8}-\d{6}(-\d+)?/?", argument) else argument


def shortened(argv: tuple) -> List[str]:
    argv = list(argv)
    subcommand = argv[0] if argv else ""
    if subcommand in ("evaluate", "predict") and len(argv) > 1:
        argv[1] = run_folder(argv[1])
    if subcommand == "train":
        resumed = value(argv, "--resume")
        if resumed is not None:
            argv = with_value(argv, "--resume", run_folder(resumed))
        argv = with_value(argv, "--max-steps", "4" if resumed is not None else "2")
    if subcommand == "verify":
        argv = with_value(argv, "--steps", "2")
    if subcommand == "bench":
        counts = [c for c in (value(argv, "--devices") or "1,2").split(",") if c.isdigit() and int(c) <= 2]
        batches = (value(argv, "--batch-sizes") or "64").split(",")
        argv = with_value(argv, "--devices", ",".join(counts or ["1", "2"]))
        argv = with_value(argv, "--batch-sizes", min(batches, key=lambda b: int(b) if b.isdigit() else 0))
        argv = with_value(with_value(argv, "--steps", "2"), "--warmup", "1")
        if value(argv, "--strategies") is None:  # every strategy: a row each, workers started each time
            argv += ["--strategies", "data"]
    return argv


def starts_workers(argv: List[str]) -> bool:
    devices = value(argv, "--devices") or "1"
    counts = [int(c) for c in devices.split(",") if c.isdigit()]
    return argv[0] == "verify" or any(c > 1 for c in counts)


COMMANDS = [command for path in pages() for command in readme_commands(path.read_text(), page_name(path))]
RUNNABLE = [c for c in COMMANDS if c.argv is not None and c.argv]
WHERE = {}  # each distinct command once, with the first page that shows it
for _command in RUNNABLE:
    WHERE.setdefault(tuple(shortened(_command.argv)), _command.page)
GROUPS = {"one process": [], "workers": []}
for _command in WHERE:
    GROUPS["workers" if starts_workers(list(_command)) else "one process"].append(list(_command))

DRIVER = r"""
import json, sys, time, traceback
from pathlib import Path
from polytrain.cli import main

def first_run():
    runs = sorted((p for p in Path("runs").glob("*") if (p / "config.json").is_file() and p.name != "LATEST"),
                  key=lambda p: (p / "config.json").stat().st_mtime)
    return str(runs[0]) if runs else "runs/none-yet"

if __name__ == "__main__":
    for index, argv in enumerate(json.loads(sys.argv[1])):
        argv = [first_run() if a == "@RUN@" else a for a in argv]
        print(f"\n@@@ command {index}: polytrain {' '.join(argv)}", flush=True)
        began = time.perf_counter()
        try:
            code = main(argv)
        except SystemExit as error:
            code = error.code if isinstance(error.code, int) else int(error.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        print(f"\n@@@ exit {index}: {code} after {time.perf_counter() - began:.1f} s", flush=True)
"""


def run_group(commands: List[List[str]], folder: Path, *, timeout: float) -> dict:
    """Run `commands` one after the other in `folder`: {index: (exit code, what it printed)}."""
    needs_run = [
        i for i, argv in enumerate(commands) if RUN in argv or any(a.startswith("runs/LATEST") for a in argv)
    ]
    if needs_run and not any(argv[0] == "train" and "--out" not in argv for argv in commands[: needs_run[0]]):
        commands = [["train", "--max-steps", "2"]] + commands  # a run folder for evaluate and predict
        offset = 1
    else:
        offset = 0
    script = folder / "readme_driver.py"
    script.write_text(DRIVER)
    process = subprocess.Popen(
        [sys.executable, str(script), json.dumps(commands)],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **ENV},
    )
    out = finish(process, timeout=timeout).stdout
    results = {}
    for index in range(len(commands)):
        body = out.split(f"@@@ command {index}:", 1)[-1] if f"@@@ command {index}:" in out else ""
        code = re.search(rf"@@@ exit {index}: (-?\d+)", out)
        results[index - offset] = (int(code.group(1)) if code else None, body.split("@@@ exit", 1)[0])
    return results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_group(GROUPS["one process"], tmp_path_factory.mktemp("readme-one"), timeout=300)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    return run_group(GROUPS["workers"], tmp_path_factory.mktemp("readme-workers"), timeout=540)


def check(results: dict, index: int, argv: List[str]) -> None:
    code, output = results[index]
    page = WHERE[tuple(argv)]
    assert code == 0, f"polytrain {shlex.join(argv)} (from {page}) exited with {code}:\n{output[-4000:]}"


def ids(group: str) -> List[str]:
    return [f"{WHERE[tuple(argv)]}: {shlex.join(argv)}" for argv in GROUPS[group]]


# The first test of a group waits for the whole group (its fixture); the group's own limit (run_group's timeout,
# which prints every process's stack) must end it before pytest-timeout's 300 s would.
@pytest.mark.timeout(360)
@pytest.mark.parametrize("index", range(len(GROUPS["one process"])), ids=ids("one process"))
def test_a_one_process_readme_command_runs(one_process, index):
    check(one_process, index, GROUPS["one process"][index])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(GROUPS["workers"])), ids=ids("workers"))
def test_a_readme_command_with_workers_runs(workers, index):
    check(workers, index, GROUPS["workers"][index])


def test_the_pages_show_commands_and_only_other_launchers_are_left_out():
    commands = {"train", "evaluate", "predict", "verify", "bench"}
    in_readme = [c for c in RUNNABLE if c.page == "README.md"]
    assert len(in_readme) >= 6 and {c.argv[0] for c in in_readme} >= commands  # the 30-second start
    assert len(RUNNABLE) >= 20 and {c.argv[0] for c in RUNNABLE} >= commands | {"generate"}
    assert {"docs/gpt.md", "docs/knobs.md", "docs/strategies/pipeline.md"} <= {c.page for c in RUNNABLE}
    assert not any(name in c.page for c in COMMANDS for name in RECORDS)
    for command in COMMANDS:
        assert command.argv is not None or command.launcher in ELSEWHERE, f"{command.page}: {command.written}"


def test_commands_are_found_and_shortened_as_written_by_hand():
    text = "\n".join(
        [
            "```bash",
            "pip install -e . && polytrain train   # trains",
            "polytrain bench --devices 1,2,4 \\",
            "    --batch-sizes 512,64 --predict 8",
            "# polytrain train --commented-out",
            "torchrun --nnodes 2 -m polytrain train",
            "```",
            "```text",
            "$ polytrain evaluate runs/20261122-224501",
            "done: run folder runs/20261122-224501",
            "polytrain printed this",
            "```",
            "```python",
            "polytrain.fit('lenet')",
            "```",
            "```bash",
            "python -m polytrain verify --devices 2 --steps 20",
            "polytrain train --resume runs/20261122-224501",
            "```",
        ]
    )
    found = readme_commands(text)
    assert [c.argv for c in found] == [
        ("train",),
        ("bench", "--devices", "1,2,4", "--batch-sizes", "512,64", "--predict", "8"),
        None,
        ("evaluate", "runs/20261122-224501"),
        ("verify", "--devices", "2", "--steps", "20"),
        ("train", "--resume", "runs/20261122-224501"),
    ]
    assert found[2].launcher == "torchrun"
    assert [shortened(c.argv) for c in found if c.argv] == [
        ["train", "--max-steps", "2"],
        [
            "bench",
            "--devices",
            "1,2",
            "--batch-sizes",
            "64",
            "--predict",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--strategies",
            "data",
        ],
        ["evaluate", RUN],
        ["verify", "--devices", "2", "--steps", "2"],
        ["train", "--resume", RUN, "--max-steps", "4"],
    ]
    assert not starts_workers(["train", "--max-steps", "2"]) and starts_workers(["bench", "--devices", "1,2"])


def test_the_list_of_what_a_resume_may_change_is_the_settings_declared_so():
    """docs/reliability.md lists the flags a resume may change; the declarations (resume="change") decide."""
    from polytrain.config import RESUMABLE_FLAGS
    from polytrain.config.flags import flag_name

    page = DOCS / "reliability.md"
    sentence = page.read_text().split("Only where and how it runs may change", 1)[1].split("(this list", 1)[0]
    assert re.findall(r"`(--[a-z-]+)`", sentence) == [flag_name(name) for name in RESUMABLE_FLAGS], (
        f"update the list in {page_name(page)} (## Resume) to the settings declared with resume='change'"
    )


def test_the_readmes_sample_output_has_the_lines_the_tool_prints(tmp_path, capfd):
    """Each line of the opening sample, numbers aside, is a line `polytrain train` prints."""
    from conftest import polytrain_here

    block = README.read_text().split("```text\n$ polytrain train\n", 1)[1].split("\n$ ", 1)[0]
    sample = [line for line in block.splitlines() if line != "..."]
    result = polytrain_here(
        capfd,
        "train",
        "--epochs",
        "1",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "256",
        "--out",
        tmp_path / "runs" / "20261122-224501",
    )
    assert result.returncode == 0, result.stderr

    def shape(line):
        return re.sub(r"\d[\d,.]*", "N", line.replace(str(tmp_path) + "/", ""))

    printed = {shape(line) for line in result.stdout.splitlines()}
    assert len(sample) == 4 and [line for line in sample if shape(line) not in printed] == []
