"""The package's import rules, read from the source (an `ast` walk over every import,
those inside functions too): which part may import which, only `vllm_plugin` imports
vLLM, and no import circle between parts or between modules.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# part -> the parts it may import. The trainer side (bridge, remote, checkpoint, changes,
# layout, protocol) never imports the server side (server, vllm_plugin) or the CLI.
MAY_IMPORT = {
    "errors": set(),
    "testing": set(),
    "protocol": {"errors"},
    "layout": {"errors"},
    "changes": {"errors"},
    "checkpoint": {"changes", "errors"},
    "remote": {"checkpoint", "changes", "layout", "protocol", "errors"},  # layout: TP shards
    "bridge": {"checkpoint", "remote", "changes", "layout", "protocol", "errors"},
    # colocate mode runs vLLM in the trainer's process: vllm_plugin.local starts it
    "integrations": {"bridge", "remote", "checkpoint", "changes", "layout", "protocol",
                     "vllm_plugin", "errors"},
    "server": {"checkpoint", "protocol", "errors"},
    "vllm_plugin": {"server", "checkpoint", "remote", "changes", "layout", "protocol",
                    "testing", "errors"},
    "cli": {"integrations", "bridge", "server", "checkpoint", "remote", "layout",
            "protocol", "vllm_plugin", "testing", "errors"},
}
ROOT = {"hotweights", "hotweights.__main__"}  # the lazy exports and `python -m`: any part


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "hotweights").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def _imports(module: str) -> list[tuple[str, int]]:
    """Every module `module` imports (absolute names), with the line."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}  # never run
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.append((base, node.lineno))
            # `from hotweights.x import y` imports the module x.y where y is one
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names
                      if f"{base}.{a.name}" in MODULES]
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {name for name, _ in _imports(m) if name in MODULES and name != m}
            for m in MODULES}


def test_every_part_has_a_docstring_that_says_its_job():
    for part in MAY_IMPORT:
        if part == "errors":
            continue
        init = SRC / "hotweights" / part / "__init__.py"
        assert init.exists(), f"{init}: every part is a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init}: no docstring"
    parts = {_part(m) for m in MODULES if m not in ROOT}
    assert parts <= set(MAY_IMPORT), f"parts without rules: {parts - set(MAY_IMPORT)}"


def test_only_vllm_plugin_imports_vllm():
    offenders = [f"{MODULES[m]}:{line} imports {name}" for m in MODULES
                 for name, line in _imports(m)
                 if name.split(".")[0] == "vllm" and _part(m) != "vllm_plugin"]
    assert not offenders, "only hotweights.vllm_plugin may import vLLM:\n" + "\n".join(offenders)


def test_each_part_imports_only_what_its_rules_allow():
    offenders = []
    for m in MODULES:
        if m in ROOT:
            continue
        own = _part(m)
        for name, line in _imports(m):
            if name.split(".")[0] != "hotweights" or name == "hotweights":
                continue
            other = _part(name)
            if other != own and other not in MAY_IMPORT[own]:
                offenders.append(f"{MODULES[m]}:{line} imports {name}: {own} may import "
                                 f"only {sorted(MAY_IMPORT[own]) or 'nothing of hotweights'}")
    assert not offenders, "\n".join(offenders)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_between_modules_or_parts():
    modules = _graph()
    parts: dict[str, set[str]] = {}
    for m, deps in modules.items():
        if m not in ROOT:
            parts.setdefault(_part(m), set()).update(_part(d) for d in deps if _part(d) != _part(m))
    for graph, what in ((modules, "modules"), (parts, "parts")):
        circle = _cycle(graph)
        assert circle is None, f"import circle between {what}: {' -> '.join(circle)}"


def test_the_rules_catch_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("argv", [["--help"], ["sync", "--help"],
                                  ["status", "http://127.0.0.1:9", "--token", "t"]])
def test_the_cli_starts_without_torch_or_vllm(argv):
    # A fresh interpreter: what `hotweights ARGV` imported, whatever its exit code (status
    # fails here: nothing listens on port 9).
    code = ("import sys\nfrom hotweights.cli.main import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'vllm', 'numpy', 'transformers', 'safetensors'})\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_public_names_resolve_on_first_use():
    code = ("import sys, hotweights\n"
            "assert 'torch' not in sys.modules, 'import hotweights loaded torch'\n"
            "for name in hotweights.__all__:\n    getattr(hotweights, name)\n"
            "print(sorted(hotweights.__all__) == sorted(hotweights._EXPORTS))\n"
            "try:\n    hotweights.nothing\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["True",
                                       "module 'hotweights' has no attribute 'nothing'"]


def test_every_error_a_caller_may_catch_is_a_public_name():
    import hotweights
    from hotweights import errors

    raised = {n for n, v in vars(errors).items()
              if isinstance(v, type) and issubclass(v, errors.HotweightsError)}
    assert raised <= set(hotweights.__all__), raised - set(hotweights.__all__)
