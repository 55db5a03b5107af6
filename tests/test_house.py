"""The package's shape: stages import only downward, no import circles, no private names across modules.

Every import in flexc (at module level and inside functions) is read with ``ast``; the rules hold for
the code as written, not for one import order.
"""
from __future__ import annotations

import ast
import pathlib
import re

import torch.nn.attention.flex_attention as torch_flex

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "flexc"

# The pipeline's stages, lowest first: a module may import its own stage and the ones below it.
# The call and its compiled path are one stage (flex_attention hands a compiled call to
# torch_compile, which plans it with the call's own rules).
STAGES = [
    ("flexc._version", "flexc.errors", "flexc.constants", "flexc.dtypes", "flexc.versions", "flexc.device",
     "flexc.compiled_launch", "flexc.workers"),
    ("flexc.mods",),
    ("flexc.analysis",),
    ("flexc.masks",),
    ("flexc.codegen",),
    ("flexc.backends",),
    ("flexc.call", "flexc.torch_compile"),
    ("flexc.tools",),
    ("flexc", "flexc.__main__"),  # the package's own face
]
TOP_LEVEL_ALLOWED = 6  # modules directly in flexc/ besides __init__, __main__, _version and errors


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


class Import:
    """One imported name: ``module`` imported by ``importer``; ``name`` when a non-module name is taken."""

    def __init__(self, importer: str, module: str, name: str | None, line: int):
        self.importer, self.module, self.name, self.line = importer, module, name, line

    def __repr__(self) -> str:
        what = f"{self.module}.{self.name}" if self.name else self.module
        return f"{self.importer}:{self.line} imports {what}"


def _imports(name: str) -> tuple[list[Import], list[tuple[str, str, int]]]:
    """The flexc imports of module ``name`` and its ``alias._private`` attribute reads of imported modules."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("flexc"):
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    found.append(Import(name, full, None, node.lineno))
                    aliases[alias.asname or alias.name] = full
                else:
                    found.append(Import(name, source, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flexc"):
                    found.append(Import(name, alias.name, None, node.lineno))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
    private_reads = [(aliases[n.value.id], n.attr, n.lineno) for n in ast.walk(tree)
                     if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                     and n.attr.startswith("_") and not n.attr.startswith("__")]
    return found, private_reads


IMPORTS = {name: _imports(name) for name in MODULES}


def _stage(module: str) -> int:
    best = max(((len(prefix), i) for i, prefixes in enumerate(STAGES) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} belongs to no stage: add its folder to STAGES"
    return best[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circles():
    graph = {name: {i.module for i in IMPORTS[name][0] if i.module in MODULES and i.module != name}
             for name in MODULES}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_crosses_a_module_line():
    # torch's own private names that flexc provides for `from torch.nn.attention.flex_attention import ...`
    torch_names = {name for name in dir(torch_flex) if name.startswith("_")}
    crossings = []
    for name, (imports, private_reads) in IMPORTS.items():
        crossings += [repr(i) for i in imports if i.name and i.name.startswith("_") and not i.name.startswith("__")
                      and i.name not in torch_names]
        crossings += [f"{name}:{line} reads {module}.{attr}" for module, attr, line in private_reads]
    assert crossings == []


def test_stages_import_only_downward():
    upward = [repr(i) for name, (imports, _) in IMPORTS.items() for i in imports
              if i.module in MODULES and _stage(i.module) > _stage(name)]
    assert upward == []


def test_backends_do_not_import_the_public_call():
    reaching = [repr(i) for name, (imports, _) in IMPORTS.items() if name.startswith("flexc.backends")
                for i in imports if i.module.startswith("flexc.call")]
    assert reaching == []


# "float64 inputs compute in float64, the rest in float32", spelled out instead of flexc.dtypes.work_dtype
WORK_DTYPE_RULE = re.compile(r'(torch\.|"|tl\.)float64"? if [\w.]+\.dtype == torch\.float64 else (torch\.|"|tl\.)float32')
# the split of the giants moves this one (its line 91); it takes work_dtype then
def test_the_work_dtype_rule_has_one_home():
    spelled = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for name, path in MODULES.items()
               if name != "flexc.dtypes"
               for text in [path.read_text()] for m in WORK_DTYPE_RULE.finditer(text)]
    assert spelled == []


def test_few_modules_at_the_top():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__", "_version", "errors"))
    assert len(top) <= TOP_LEVEL_ALLOWED, top


def test_the_module_table_of_the_architecture_names_every_module():
    """docs/architecture.md's module-by-module table names each module: a path below the folder of
    the bold row above it (or below flexc/ itself)."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## Module by module"):doc.index("## Where a new thing goes")]
    named, folder = set(), "flexc/"
    for row in table.splitlines():
        first = row.split("|")[1] if row.startswith("| ") else ""
        if first.strip().startswith("**`flexc/"):  # a stage's row
            folder = first.split("`")[1]
            continue
        for path in (p.strip() for p in first.replace("`", "").split(",")):
            named |= {folder + path, "flexc/" + path}
    modules = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" or p.parent == PACKAGE}
    assert sorted(modules - named) == []


# Where a backend's name may be spelled as a string in flexc (everywhere else reads flexc.backends.registry):
# a new backend is its package plus one registry line, and no other module lists the backends.
# (bench/, examples/ and tests/ are users of kernel_options["BACKEND"] and spell names as users do.)
BACKEND_NAME_ALLOWED = {
    "flexc/backends/registry.py": "the one list of backend names",
    "flexc/call/compat.py": "the Literal type of torch's kernel_options['BACKEND'], spelled as torch's signature",
}


def _backend_name_strings(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` holding a string constant that is exactly a backend name (docstrings and
    messages hold names inside longer text, which is fine)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_backend_names_are_spelled_in_the_registry_only():
    from flexc.backends import registry

    names = set(registry.names())
    own_packages = {f"flexc/backends/{name.lower()}/" for name in names} | {"flexc/backends/cpu/"}
    spelled = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in MODULES.values()
               if str(path.relative_to(PACKAGE.parent)) not in BACKEND_NAME_ALLOWED
               and not str(path.relative_to(PACKAGE.parent)).startswith(tuple(own_packages))
               for line in _backend_name_strings(path.read_text(), names)]
    assert spelled == [], "read the name from flexc.backends.registry (TORCH, TRITON, AUTO, names())"


def test_backend_name_finder_finds_a_spelled_name():
    assert _backend_name_strings('x = {"BACKEND": "TRITON"}\n"""TRITON docs"""\n', {"TRITON"}) == [1]


# ---- kernel kinds: dispatch by the spec's type, specs built by keyword ---------------------------------
# A kernel kind is one registration (its generator: flexc.codegen.spec.generates; its launch pieces: dicts
# keyed by its spec type), never a branch on isinstance(spec, ...) in each job's module; and its spec's
# fields are keyword-only, so no construction passes them by position.

def _spec_class_names() -> set[str]:
    import importlib

    from flexc.codegen.spec import KernelSpec

    for name in MODULES:
        if name.startswith("flexc.codegen."):
            importlib.import_module(name)
    found, todo = set(), [KernelSpec]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return found


SPEC_CLASSES = _spec_class_names()


def _named(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _spec_type_tests(source: str, specs: set[str]) -> list[int]:
    """Lines of ``source`` that branch on a spec's class: ``isinstance(x, Spec)`` (or a tuple of them),
    ``issubclass``, and ``type(x) is / == / in`` a spec class."""
    def names_specs(node):
        nodes = node.elts if isinstance(node, ast.Tuple) else [node]
        return any(_named(n) in specs for n in nodes)
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and _named(node.func) in ("isinstance", "issubclass") and len(node.args) == 2
                and names_specs(node.args[1])):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and _named(node.left.func) == "type"
              and any(names_specs(c) for c in node.comparators)):
            lines.append(node.lineno)
    return lines


def _positional_spec_constructions(source: str, specs: set[str]) -> list[int]:
    """Lines of ``source`` that construct a spec class with a positional argument (``*args`` included)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and _named(node.func) in specs and node.args]


def test_kernel_kinds_are_dispatched_by_the_specs_type_not_by_isinstance():
    branching = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in MODULES.values()
                 for line in _spec_type_tests(path.read_text(), SPEC_CLASSES)]
    assert branching == [], ("register the kind instead: its generator with flexc.codegen.spec.generates, its launch "
                             "pieces in a dict keyed by its spec type")


def test_specs_are_built_by_keyword():
    roots = [PACKAGE.parent / folder for folder in ("flexc", "tests", "bench", "examples")]
    positional = [f"{path.relative_to(PACKAGE.parent)}:{line}" for root in roots for path in sorted(root.rglob("*.py"))
                  for line in _positional_spec_constructions(path.read_text(), SPEC_CLASSES)]
    assert positional == [], "name every field: ForwardSpec(score_mod=..., mask_mod=..., dtype=..., ...)"


def test_the_spec_finders_find_a_type_test_and_a_positional_construction():
    source = ("if isinstance(spec, ForwardSpec): pass\nif isinstance(spec, (int, codegen.DecodeSpec)): pass\n"
              "if type(spec) is BackwardSpec: pass\nif isinstance(spec, dict): pass\n"
              "ForwardSpec(None, mask_mod=None)\nForwardSpec(score_mod=None)\nDecodeSpec(*fields)\n")
    specs = {"ForwardSpec", "DecodeSpec", "BackwardSpec"}
    assert _spec_type_tests(source, specs) == [1, 2, 3]
    assert _positional_spec_constructions(source, specs) == [5, 7]
    assert {"KernelSpec", "ForwardSpec", "BackwardSpec", "BackwardRowsSpec", "DecodeSpec", "MergeSpec",
            "PrologueSpec"} <= SPEC_CLASSES
