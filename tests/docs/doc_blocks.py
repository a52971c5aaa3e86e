"""The code blocks of README.md and docs/*.md as runnable cases, and the runner that executes a Python case.

Which blocks are cases:
- every ```python (or ```py) block is one case, run in a fresh interpreter (``torchpar.init`` must come
  before JAX is imported, so blocks never share a process unless marked ``continue``);
- every command line of a ```bash / ```sh / ```shell / ```console block is one case (``console``: the lines
  starting with ``$``). A command must run Python (``python``, ``python3``, ``.venv/bin/python``); the
  interpreter becomes this one, a relative script path (``examples/compare_loss.py``) the repository's file,
  and it runs in a temporary directory, so the files it writes land there. Other commands (``make``, ``pip``)
  are not run: their block must be marked ``skip``.
- other fences (```text, a bare ```) are prose: never run, and they take no markers.
A case's id is the markdown file and the line of its fence (Python) or of its command (shell): ``README.md:L8``.

Markers are HTML comments (invisible when the markdown is rendered) on the lines right above a fence, one per
comment, several allowed; their arguments are split like a shell line (quote an argument holding spaces):

    <!-- doctest: skip reason="needs a running Ray cluster (address='auto')" -->
    <!-- doctest: setup tiny-lm -->          run the named snippet of SETUPS first (what the prose elides)
    <!-- doctest: continue -->               run after the previous Python block of the file, in its interpreter
    <!-- doctest: replace "range(100)" "range(2)" -->   run with OLD replaced by NEW (OLD must occur)

``continue`` re-runs the chain of blocks it continues in the same process (keep chains short); ``replace`` is
the only way a case runs other text than the page shows (tiny sizes, a simulated cluster for a real one), and
it is in the page for a reader to see. A marker that is unknown, malformed, on a prose fence, or not right
above a fence is an error (:class:`DocBlockError`), as is a non-Python command in an unskipped block.

Run as a script (``python doc_blocks.py spec.json``) this module is the runner of a Python case: it executes
the case's pieces in one namespace, each compiled with the markdown file as its file name and padded to its
line, so a traceback names the page and line (``File ".../README.md", line 19``), under the test session's
garbage-collector thresholds (``tests/conftest.py``); it always calls
``torchpar.shutdown()`` at the end, and first writes the processes it started (Ray's) to ``spec["children"]``
so the caller can check that none outlives it.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shlex
import sys
from pathlib import Path

PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHON_COMMANDS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}

SETUPS = {
    "tiny-lm": (
        "import torch, torchpar\n"
        "class TinyLM(torch.nn.Module):  # returns its loss, as a HuggingFace model given labels does\n"
        "    def __init__(self, vocab=64, width=32):\n"
        "        super().__init__()\n"
        "        self.embed = torch.nn.Embedding(vocab, width)\n"
        "        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),\n"
        "                                       torch.nn.Linear(2 * width, vocab))\n"
        "    def forward(self, input_ids, labels):\n"
        "        logits = self.mlp(self.embed(input_ids))\n"
        "        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())\n"
        "model = TinyLM()\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)\n"
        "ids = torch.randint(0, 64, (8, 16))\n"
        "batch = {'input_ids': ids, 'labels': ids}\n"
        "loader = [batch, batch]\n"
    ),
    "imports": "import torch, transformers, torchpar\n",
}
"""What a block may take as given. ``tiny-lm``: ``model`` (a two-layer language model that returns its loss,
cheap to compile), ``optimizer``, ``batch`` (a dict like the README quickstart's) and ``loader`` (two batches).
None of them imports JAX, so a block can still call ``torchpar.init``."""

_MARKER = re.compile(r"^\s*<!--\s*doctest:(.*?)-->\s*$")
_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
_RAY_WORDS = ('cluster="ray"', "cluster='ray'")


class DocBlockError(ValueError):
    """A marker or block the docs test cannot run as written; names the file and line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Marker:
    line: int
    name: str
    args: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One fenced block: the line of its opening fence, its language and text, the markers above it."""

    path: Path
    line: int
    lang: str
    source: str
    markers: tuple[Marker, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Piece:
    """Code executed by the runner: ``source`` starts at line ``line`` of ``filename``."""

    filename: str
    line: int
    source: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One test case: the Python pieces to run in order, or one command's arguments."""

    id: str
    kind: str  # "python" or "shell"
    pieces: tuple[Piece, ...] = ()
    argv: tuple[str, ...] = ()
    skip_reason: str | None = None

    @property
    def uses_ray(self) -> bool:
        """Starts Ray processes (an embedded Ray instance): pytest's ``ray`` mark."""
        return (self.kind == "python" and self.skip_reason is None
                and any(word in piece.source for piece in self.pieces for word in _RAY_WORDS))


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a markdown file with the markers right above it."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    pending: list[Marker] = []
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        fence = _FENCE.match(lines[i])
        if marker:
            tokens = _split(marker.group(1), path, i + 1)
            if not tokens:
                raise DocBlockError(f"{path}:{i + 1}: empty doctest marker")
            pending.append(Marker(line=i + 1, name=tokens[0], args=tuple(tokens[1:])))
            i += 1
            continue
        if pending and not fence:
            raise DocBlockError(f"{path}:{pending[0].line}: doctest marker not right above a ``` fence")
        if fence:
            indent, lang = fence.group(1), fence.group(2).lower()
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise DocBlockError(f"{path}:{i + 1}: ``` fence never closed")
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
            blocks.append(Block(path=path, line=i + 1, lang=lang, source="\n".join(body) + "\n",
                                markers=tuple(pending)))
            pending = []
            i = end + 1
            continue
        i += 1
    if pending:
        raise DocBlockError(f"{path}:{pending[0].line}: doctest marker not right above a ``` fence")
    return blocks


def cases(path: Path, root: Path, text: str | None = None) -> list[Case]:
    """The test cases of one markdown file (``root`` makes the ids relative)."""
    rel = path.relative_to(root).as_posix() if path.is_absolute() and path.is_relative_to(root) else str(path)
    result: list[Case] = []
    chain: list[tuple[Block, str]] = []  # the Python blocks a `continue` block runs after, with their code
    chain_setup: tuple[Piece, ...] = ()
    chain_skipped = False
    for block in parse_blocks(path, text):
        options = _options(block)
        if block.lang in PYTHON_LANGS:
            source = _replaced(block, options["replace"])
            if options["continue"]:
                if not chain:
                    raise DocBlockError(f"{path}:{block.line}: `continue` with no Python block before it")
                if options["setup"]:
                    raise DocBlockError(f"{path}:{block.line}: `setup` belongs on the first block of a chain")
                chain.append((block, source))
                skip = options["skip"] or ("the block it continues is skipped" if chain_skipped else None)
            else:
                chain = [(block, source)]
                chain_setup = tuple(Piece(filename=f"<doctest setup {name}>", line=1, source=SETUPS[name])
                                    for name in options["setup"])
                skip = options["skip"]
            chain_skipped = skip is not None
            pieces = chain_setup + tuple(Piece(filename=str(b.path), line=b.line + 1, source=s) for b, s in chain)
            result.append(Case(id=f"{rel}:L{block.line}", kind="python", pieces=pieces, skip_reason=skip))
        elif block.lang in SHELL_LANGS:
            if options["setup"] or options["continue"]:
                raise DocBlockError(f"{path}:{block.line}: `setup` and `continue` apply to Python blocks only")
            result.extend(_shell_cases(block, rel, options))
        elif block.markers:
            raise DocBlockError(f"{path}:{block.line}: doctest marker on a ```{block.lang} block, which never runs")
    return result


def collect(root: Path) -> list[Case]:
    """The cases of README.md and docs/*.md, in file order."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [case for path in paths for case in cases(path, root)]


def _split(text: str, path: Path, line: int) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as error:
        raise DocBlockError(f"{path}:{line}: malformed doctest marker ({error})") from None


def _options(block: Block) -> dict:
    options: dict = {"skip": None, "setup": [], "continue": False, "replace": []}
    for marker in block.markers:
        where = f"{block.path}:{marker.line}"
        if marker.name == "skip":
            reasons = [arg.removeprefix("reason=") for arg in marker.args if arg.startswith("reason=")]
            if len(marker.args) != 1 or not reasons or not reasons[0].strip():
                raise DocBlockError(f'{where}: write `skip reason="why"`, got {marker.args}')
            options["skip"] = reasons[0]
        elif marker.name == "setup":
            unknown = [name for name in marker.args if name not in SETUPS]
            if not marker.args or unknown:
                raise DocBlockError(f"{where}: `setup` takes names of {sorted(SETUPS)}, got {list(marker.args)}")
            options["setup"].extend(marker.args)
        elif marker.name == "continue":
            if marker.args:
                raise DocBlockError(f"{where}: `continue` takes no arguments, got {marker.args}")
            options["continue"] = True
        elif marker.name == "replace":
            if len(marker.args) != 2:
                raise DocBlockError(f'{where}: write `replace "OLD" "NEW"`, got {marker.args}')
            options["replace"].append((marker, *marker.args))
        else:
            raise DocBlockError(f"{where}: unknown doctest marker {marker.name!r} "
                                "(skip, setup, continue, replace)")
    return options


def _replaced(block: Block, replacements: list) -> str:
    source = block.source
    for marker, old, new in replacements:
        if old not in source:
            raise DocBlockError(f"{block.path}:{marker.line}: `replace` text {old!r} does not occur in the block")
        source = source.replace(old, new)
    return source


def _shell_cases(block: Block, rel: str, options: dict) -> list[Case]:
    commands = _commands(block)
    unused = [(marker, old) for marker, old, _ in options["replace"] if not any(old in cmd for _, cmd in commands)]
    if unused:
        raise DocBlockError(f"{block.path}:{unused[0][0].line}: `replace` text {unused[0][1]!r} occurs in no command")
    result = []
    for line, command in commands:
        for _, old, new in options["replace"]:
            command = command.replace(old, new)
        argv = tuple(shlex.split(command, comments=True))
        if options["skip"] is None and argv[0] not in PYTHON_COMMANDS:
            raise DocBlockError(f"{block.path}:{line}: {argv[0]!r} is not a Python command the docs test runs; "
                                'mark the block `skip reason="..."`')
        result.append(Case(id=f"{rel}:L{line}", kind="shell", argv=argv, skip_reason=options["skip"]))
    return result


def _commands(block: Block) -> list[tuple[int, str]]:
    """(markdown line, command) of each command of a shell block; backslash continuations joined."""
    commands: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, raw in enumerate(block.source.splitlines()):
        line = raw.strip()
        if pending is None:
            if block.lang == "console":
                if not line.startswith("$"):
                    continue
                line = line[1:].strip()
            if not line or line.startswith("#"):
                continue
            pending = (block.line + 1 + offset, "")
        text = pending[1] + " " + line.removesuffix("\\")
        pending = (pending[0], text.strip())
        if not line.endswith("\\"):
            commands.append(pending)
            pending = None
    if pending is not None:
        commands.append(pending)
    return commands


# --- the runner of a Python case (in its own interpreter) --------------------------------------------------


def _descendants() -> list[tuple[int, str]]:
    """(pid, start time) of every live process below this one, from /proc (empty where there is none)."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(entry.name)
        parents.setdefault(int(fields[1]), []).append(pid)
        starts[pid] = fields[19]
    found, todo = [], [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append((child, starts[child]))
            todo.append(child)
    return found


def run(spec_path: str) -> None:
    gc.set_threshold(50_000, 20, 10)  # the test session's collector (tests/conftest.py), before the case imports torch
    spec = json.loads(Path(spec_path).read_text())
    namespace = {"__name__": "__main__"}
    try:
        for piece in spec["pieces"]:
            code = compile("\n" * (piece["line"] - 1) + piece["source"], piece["filename"], "exec")
            exec(code, namespace)  # noqa: S102 -- running the docs' own code is this runner's job
    finally:
        Path(spec["children"]).write_text(json.dumps(_descendants()))
        if "torchpar" in sys.modules:
            sys.modules["torchpar"].shutdown()


if __name__ == "__main__":
    run(sys.argv[1])
