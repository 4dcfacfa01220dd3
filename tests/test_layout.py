"""The package's layout, read from its source with ``ast`` (nothing is imported but ``analysis`` itself, to find it):
no import circle among its modules, counting the imports written inside functions, and every import of the
package's own modules written inside a function says on its line, or the line above, why it is lazy. And its public
API reads like scikit-learn's: options after a model and tokens are keyword-only, and every exported function and
class documents its parameters (or attributes) in numpy-doc sections."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import tokenize
from pathlib import Path

import analysis
from analysis.core.results import Result

ROOT = Path(analysis.__file__).resolve().parent
PACKAGE = "analysis"
REASONS = ("import time", "optional", "cycle")  # what a lazy import's comment says (one of them)


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _targets(module: str, node: ast.AST) -> set[str]:
    """The package's modules an import statement runs: the named module (or a submodule named in ``from X import
    sub``), and the packages on the way to it that are not already being imported around ``module``."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if module in PACKAGES else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names = [node.args[0].value]
    out = set()
    for name in names:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        while name and name not in MODULES:  # `from analysis.x import y`: y is a name in module analysis.x
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
            out |= {a for a in _ancestors(name) if a in MODULES} - _ancestors(module) - {module}
    return out


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import of the package's own modules."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for target in _targets(module, child):
                found.append((target, child.lineno, inner))
            visit(child, inner)

    visit(tree, False)
    return found


def _graph() -> dict[str, dict[str, tuple[int, bool]]]:
    """module -> {imported module: (first line, lazy)}; an edge is lazy only if every import along it is."""
    graph: dict[str, dict[str, tuple[int, bool]]] = {m: {} for m in MODULES}
    for module, path in MODULES.items():
        for target, line, lazy in _imports(module, path):
            old = graph[module].get(target)
            if old is None or (old[1] and not lazy):
                graph[module][target] = (line, lazy)
    return graph


def _strongly_connected(graph) -> list[set[str]]:
    """Tarjan's components with more than one module (or a module importing itself)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _cycle_text(graph, comp: set[str]) -> str:
    """One circle through the component, written
    out with where each import is (line, in a function or not), then every module of the component."""
    start = min(comp)
    paths, seen = {start: [start]}, {start}
    queue = [start]
    while queue:  # breadth first: the shortest way back to start
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = paths[v] + [start]
                return (
                    " -> ".join(
                        f"{a} (line {graph[a][b][0]}{', in a function' if graph[a][b][1] else ''})"
                        for a, b in zip(path, path[1:])
                    )
                    + f" -> {start}; the circle's modules: {sorted(comp)}"
                )
            if w in comp and w not in seen:
                seen.add(w)
                paths[w] = paths[v] + [w]
                queue.append(w)
    return ", ".join(sorted(comp))


def test_the_layout_reader_sees_in_function_imports():
    """The reader finds what it must: hooks' imports at the top, a lazy import in models, the implicit package."""
    graph = _graph()
    assert (
        "analysis.model.families" in graph["analysis.model.hooks"]
        and not graph["analysis.model.hooks"]["analysis.model.families"][1]
    )
    assert graph["analysis.model.loading"]["analysis.model.reference.checkpoint"][
        1
    ]  # load_reference: inside load_model
    assert "analysis.model.reference" in graph["analysis.model.probes"]  # importing its data module runs its __init__
    assert "analysis" not in graph["analysis.model.hooks"]  # the package being imported around it is no edge


def test_no_import_circle_among_the_package_modules():
    """Kept by hand beside import-linter's contracts: its ``acyclic_siblings`` counts a package with its modules as
    one, so a circle through a package's ``__init__`` and one of its own modules (importing a name from the package
    that imports that module) goes unseen there; here every module is a node, and importing ``a.b.c`` runs
    ``a.b``'s ``__init__`` too."""
    graph = _graph()
    circles = list(_strongly_connected(graph))
    assert not circles, "import circles (in-function imports counted):\n" + "\n".join(
        _cycle_text(graph, c) for c in circles
    )


def _comment_lines(path: Path) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT and any(r in t.string.lower() for r in REASONS)}


def _lazy_package_imports(module: str, path: Path) -> list[tuple[int, int]]:
    """(first line, last line) of each import of the package's own modules inside a function, where a run of such
    imports one after another counts as one (the comment above the first covers the run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    runs = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for body in (getattr(n, f, None) for n in ast.walk(fn) for f in ("body", "orelse", "finalbody")):
            if not isinstance(body, list):
                continue
            for prev, stmt in zip([None] + body[:-1], body):
                if not isinstance(stmt, (ast.Import, ast.ImportFrom)) or not _targets(module, stmt):
                    continue
                if (
                    runs
                    and isinstance(prev, (ast.Import, ast.ImportFrom))
                    and _targets(module, prev)
                    and runs[-1][1] == prev.end_lineno
                    and prev.end_lineno + 1 == stmt.lineno
                ):
                    runs[-1] = (runs[-1][0], stmt.end_lineno)
                else:
                    runs.append((stmt.lineno, stmt.end_lineno))
    return sorted(set(runs))


def test_every_lazy_import_of_the_package_says_why():
    missing = []
    for module, path in MODULES.items():
        comments = _comment_lines(path)
        for first, last in _lazy_package_imports(module, path):
            if not comments & set(range(first - 1, last + 1)):
                missing.append(f"{path.relative_to(ROOT.parent)}:{first}")
    assert not missing, (
        "imports of the package's modules inside functions without a comment on their line or the "
        f"line above saying why they are lazy ({' / '.join(REASONS)}): {missing}"
    )


def test_no_submodule_shadows_an_exported_name():
    """``analysis.x`` must mean one thing: a submodule named like a function or class that ``analysis`` exports would
    replace it as the package's attribute once something imports the submodule by its dotted name."""
    submodules = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    clash = sorted(submodules & set(analysis.__all__))
    assert not clash, f"submodules named like names analysis exports: {clash}; rename the module."


# ----------------------------------------------------------------------------------------------
# The public API reads like scikit-learn's: options keyword-only, parameters and attributes documented
# ----------------------------------------------------------------------------------------------

LEADING = ("model", "tokens")  # the data a function takes first; every option after them is keyword-only


def _public_functions(tree: ast.Module):
    """Public module-level functions, and the ``__init__`` of public classes (as ``Class``: an accumulator built
    from a model takes its options as a function does)."""
    out = []
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_"):
            out.append(n)
        elif isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
            init = next((b for b in n.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
            if init is not None:
                out.append(ast.FunctionDef(name=n.name, args=init.args, lineno=init.lineno))
    return out


def _positional_options(fn: ast.FunctionDef) -> list[str]:
    """The parameters of a function taking ``model`` (then maybe ``tokens``) first that have a default yet can still
    be given by position: the leading data arguments are exempt, required arguments after them too."""
    params = fn.args.posonlyargs + fn.args.args
    if params and params[0].arg == "self":  # a class's __init__
        params = params[1:]
    if not params or params[0].arg != LEADING[0]:
        return []
    lead = 2 if len(params) > 1 and params[1].arg == LEADING[1] else 1
    with_default = params[len(params) - len(fn.args.defaults) :]
    return [p.arg for p in with_default if p not in params[:lead]]


def _keyword_offenders(tree: ast.Module, where: str) -> list[str]:
    return [
        f"{where}:{fn.lineno} {fn.name}({', '.join(bad)})"
        for fn in _public_functions(tree)
        if (bad := _positional_options(fn))
    ]


def test_the_keyword_checker_flags_a_positional_option():
    bad = ast.parse(
        "def bad(model, tokens, layer, eps=0.3, *, batch_size=None): ...\n"
        "def also_bad(model, k=1): ...\n"
        "def good(model, tokens=None, *, eps=0.3): ...\n"
        "def not_a_model_function(x, dim=-1): ...\n"
        "def _private(model, eps=0.3): ...\n"
        "class BadAccumulator:\n"
        "    def __init__(self, model, T, eps=0.3): ...\n"
        "class GoodAccumulator:\n"
        "    def __init__(self, model, T, *, eps=0.3): ...\n"
    )
    assert _keyword_offenders(bad, "inline") == [
        "inline:1 bad(eps)",
        "inline:2 also_bad(k)",
        "inline:7 BadAccumulator(eps)",
    ]


def test_options_after_model_and_tokens_are_keyword_only():
    offenders = []
    for module, path in MODULES.items():
        offenders += _keyword_offenders(ast.parse(path.read_text()), str(path.relative_to(ROOT.parent)))
    assert not offenders, (
        "public functions (and classes) taking a model first whose options (parameters with a "
        "default after model / tokens) can still be given by position; put `*` before them:\n" + "\n".join(offenders)
    )


def _section(doc: str | None, name: str) -> bool:
    """Whether a numpy-doc docstring has the section ``name`` (its title, then a line of dashes)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    return any(a.strip() == name and b.strip() and set(b.strip()) == {"-"} for a, b in zip(lines, lines[1:]))


def _entries(doc: str, name: str) -> set[str]:
    """The names a numpy-doc section lists: its unindented lines up to the next section, ``a, b : type`` naming a
    and b (``**kwargs`` as kwargs)."""
    lines = inspect.cleandoc(doc).splitlines()
    out, inside = set(), False
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and line.strip() and set(lines[i + 1].strip()) == {"-"}:
            inside = line.strip() == name
        elif inside and line.strip() and not line.startswith(" ") and set(line.strip()) != {"-"}:
            out |= {n.strip().lstrip("*") for n in line.split(" : ")[0].split(",")}
    return out


def _documented(obj) -> list[str]:
    """What the docstring of an exported function or class lacks: a function ``Parameters`` naming each parameter
    (when it takes any) and ``Returns``; a result class (a dataclass or a ``Result``) ``Attributes`` naming every
    public field; any other class (an error) a docstring."""
    doc = inspect.getdoc(obj)
    if not doc:
        return ["a docstring"]
    if inspect.isfunction(obj):
        params = [p for p in inspect.signature(obj).parameters if not p.startswith("_")]
        lack = [
            s
            for s in (["Parameters"] if params else []) + ["Returns"]
            if not _section(doc, s) and not (s == "Returns" and _section(doc, "Yields"))
        ]
        return lack or [f"parameter {p}" for p in params if p not in _entries(doc, "Parameters")]
    if dataclasses.is_dataclass(obj) or issubclass(obj, Result):
        if not _section(doc, "Attributes"):
            return ["Attributes"]
        names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
        return [f"field {n}" for n in names if not n.startswith("_") and n not in _entries(doc, "Attributes")]
    return []


def test_the_docstring_checker_flags_what_is_missing():
    def prose(model, tokens, eps=0.3):
        """Sink of ``model`` on ``tokens`` (N, T), in prose."""

    def partly(model, tokens, *, eps=0.3, **kwargs):
        """Sink.

        Parameters
        ----------
        model
            A model.
        tokens : torch.Tensor, shape (N, T)
        **kwargs
            Passed on.

        Returns
        -------
        SinkResult
        """

    @dataclasses.dataclass
    class Half(Result):
        """A result.

        Attributes
        ----------
        alpha : torch.Tensor, shape (N, L, H)
            Documented.
        """

        alpha: object
        eps: float

    assert _documented(prose) == ["Parameters", "Returns"]
    assert _documented(partly) == ["parameter eps"]
    assert _documented(Half) == ["field eps"]
    assert _documented(analysis.sink_metric) == [] and _documented(analysis.SinkResult) == []


def test_every_exported_function_and_class_documents_its_parameters_or_attributes():
    exported = {name: getattr(analysis, name) for name in analysis.__all__}
    missing = {
        name: lack
        for name, obj in exported.items()
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and (lack := _documented(obj))
    }
    assert not missing, (
        "exported names whose numpy-doc docstring lacks a section (functions: Parameters and Returns; "
        f"result classes: Attributes naming every field): {missing}"
    )


def _public_objects():
    """(module, name, object) of every public function and class each module defines (``__main__`` modules, which
    run when imported, left out)."""
    for module in sorted(MODULES):
        if module.endswith("__main__"):
            continue
        mod = importlib.import_module(module)
        for name, obj in vars(mod).items():
            if (
                not name.startswith("_")
                and (inspect.isfunction(obj) or inspect.isclass(obj))
                and obj.__module__ == module
            ):
                yield module, name, obj


def test_every_result_class_of_the_package_documents_its_fields():
    """Beyond the exported names: every public dataclass and ``Result`` of every module (the results analyses return,
    their parts, configs) has an ``Attributes`` section naming each public field."""
    missing = {
        f"{module}.{name}": lack
        for module, name, obj in _public_objects()
        if inspect.isclass(obj)
        and (dataclasses.is_dataclass(obj) or issubclass(obj, Result))
        and (lack := _documented(obj))
    }
    assert not missing, f"result classes whose docstring lacks an Attributes section or a field in it: {missing}"


def test_every_public_function_of_the_package_documents_its_parameters():
    """Beyond the exported names: every public function of every module has ``Parameters`` naming each of its
    parameters and ``Returns`` (or ``Yields``)."""
    missing = {
        f"{module}.{name}": lack
        for module, name, obj in _public_objects()
        if inspect.isfunction(obj) and (lack := _documented(obj))
    }
    assert not missing, f"public functions whose docstring lacks a section or a parameter: {missing}"


# ----------------------------------------------------------------------------------------------
# The tree draws the pipeline: each subpackage imports only those below it
# ----------------------------------------------------------------------------------------------

# Bottom to top. A module of one floor may import its own floor and the floors below, never one above (in-function
# imports counted). The top-level ``analysis`` package and its ``__main__`` (the CLI) stand above them all.
# import-linter's layers contract in pyproject.toml keeps it (tests/test_lint.py runs it and checks it names these).
FLOORS = (
    "core",
    "model",
    "engine",
    "sinks",
    "chain",
    "positions",
    "causal",
    "dynamics",
    "train",
    "streaming",
    "quant",
    "figures",
    "report",
)


# ----------------------------------------------------------------------------------------------
# Functions a reader can hold in mind: no body over MAX_BODY lines
# ----------------------------------------------------------------------------------------------

MAX_BODY = 60  # lines of a function's body, from its first statement after the docstring to its end


def _long_functions(tree: ast.Module, where: str, limit: int = MAX_BODY) -> list[str]:
    """``where:line name (n lines)`` for every function (methods and nested functions too) whose body, docstring not
    counted, runs over ``limit`` lines."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = fn.body
        if (
            isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body = body[1:]
        if body and (n := fn.end_lineno - body[0].lineno + 1) > limit:
            out.append(f"{where}:{fn.lineno} {fn.name} ({n} lines)")
    return out


def test_the_length_checker_counts_the_body_without_its_docstring():
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    long = ast.parse(f'def long():\n    """Doc.\n\n    More.\n    """\n{body}\n')
    short = ast.parse('def short():\n    """Doc.\n\n    More.\n    """\n' + "\n".join(body.splitlines()[:60]) + "\n")
    assert _long_functions(long, "inline") == ["inline:1 long (61 lines)"] and _long_functions(short, "inline") == []


def test_no_function_body_runs_over_sixty_lines():
    long = []
    for module, path in MODULES.items():
        long += _long_functions(ast.parse(path.read_text()), str(path.relative_to(ROOT.parent)))
    assert not long, (
        f"function bodies over {MAX_BODY} lines (docstring not counted); split them into functions "
        "named for what each part does:\n" + "\n".join(long)
    )


# ----------------------------------------------------------------------------------------------
# The registry of analyses: every registered analysis returns a Result
# ----------------------------------------------------------------------------------------------


def test_every_registered_analysis_returns_a_result():
    """Each analysis a module registers (``analysis.core.registry``) declares result types that keep the protocol;
    only the pass products others read (the baseline, the residual stream) are exempt, and those have no section."""
    from analysis.core import registry
    from analysis.report.one_pass import discover

    found = discover()  # every module whose source registers one, imported
    assert found and set(found) == {a.module for a in registry.analyses()}, "a registration the source scan misses"
    bad = {
        a.name: [getattr(t, "__name__", t) for t in a.results]
        for a in registry.analyses()
        if not a.product and not all(inspect.isclass(t) and issubclass(t, Result) for t in a.results)
    }
    assert not bad, f"registered analyses whose result is not an analysis.core.results.Result: {bad}"
    products = [a.name for a in registry.analyses() if a.product and a.sections]
    assert not products, f"pass products with a report section (they have no text to show): {products}"


# Tests mirror the package: tests/<floor>/ holds the tests of analysis/<floor>/; the root keeps only the tests of the
# whole package (its layout, docs, command line, public interface, notebooks, GPU kit and wheel) and the shared
# helpers.
CROSS_CUTTING = {
    "test_bench_scale",
    "test_cli",
    "test_cli_vocabulary",
    "test_device_guard",
    "test_docs",
    "test_docs_site",
    "test_gpu_kit",
    "test_interface",
    "test_layout",
    "test_lint",
    "test_notebooks_published",
    "test_notebooks_templates",
    "test_shards",
    "test_wheel",
}


def test_the_tests_mirror_the_package():
    tests = ROOT.parent / "tests"
    stray = sorted(p.stem for p in tests.glob("test_*.py") if p.stem not in CROSS_CUTTING)
    assert not stray, (
        f"test files at tests/ root {stray}: move each to tests/<floor>/ (one of {FLOORS}) of what it tests"
    )
    folders = sorted(d.name for d in tests.iterdir() if d.is_dir() and any(d.glob("test_*.py")))
    assert set(folders) <= set(FLOORS), f"test folders {sorted(set(folders) - set(FLOORS))} name no floor of analysis/"
    assert all((tests / d / "__init__.py").is_file() for d in folders), "each tests/<floor>/ needs an __init__.py"
    assert len(folders) >= 10, folders
