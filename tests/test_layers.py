"""The direction of every import in the package (DESIGN.md §7), checked by reading the source.

Layers, lowest first; a module may import from its own layer or any lower one, never from a
higher one, and the whole graph has no cycle (imports inside functions and under
``TYPE_CHECKING`` count: they are dependencies too). Every module must be placed: a new
module that is not fails here until someone decides where it belongs.

The engine side (``kvxfer.client``, ``kvxfer.connector``: loaded into vLLM's processes) is a
column of its own beside the sidecar: it may use the base, the pure logic and the engine's
half of the memory channel, never the daemon. ``kvxfer.testing`` (synthetic engines,
harnesses, benchmarks) is imported by the CLI alone.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

LAYERS: list[tuple[str, list[str]]] = [
    ("base: wire protocol, errors, configuration", [
        "kvxfer", "kvxfer.protocol*", "kvxfer.errors", "kvxfer.config", "kvxfer.targets", "kvxfer.logs",
        "kvxfer.control.v1*", "kvxfer.hostkey",
    ]),
    ("pure logic: no asyncio, sockets, NIXL or threads", [
        "kvxfer.topology", "kvxfer.leases", "kvxfer.abandoned", "kvxfer.integrity", "kvxfer.auth",
        "kvxfer.pairing",
        "kvxfer.sidecar.lifecycle", "kvxfer.sidecar.plan", "kvxfer.sidecar.admission",
        "kvxfer.sidecar.validate", "kvxfer.sidecar.receive", "kvxfer.sidecar.nixl_types",
        "kvxfer.sidecar.peer_book", "kvxfer.sidecar.ownership", "kvxfer.sidecar.staging",
        "kvxfer.sidecar.liveness", "kvxfer.sidecar.lease_words", "kvxfer.sidecar.layer_stream",
        "kvxfer.sidecar.outbox",
    ]),
    ("ports and memory: the NIXL thread, registrations, pools, metrics", [
        "kvxfer.sidecar.nixl*", "kvxfer.sidecar.registry", "kvxfer.vmm", "kvxfer.pool",
        "kvxfer.memchannel", "kvxfer.ringchannel",
        "kvxfer.memory", "kvxfer.sidecar.mapping", "kvxfer.sidecar.pool_server",
        "kvxfer.observe", "kvxfer.systemd", "kvxfer.sidecar.procfs", "kvxfer.sidecar.sockdir",
        "kvxfer.sidecar.loop_lag", "kvxfer.gc_heap", "kvxfer.transfer_gauges",
    ]),
    ("I/O shells: peers, holds, receiver, views", [
        "kvxfer.status", "kvxfer.sidecar.peer*",
        "kvxfer.sidecar.holds", "kvxfer.sidecar.receiver", "kvxfer.sidecar.engine_server",
        "kvxfer.sidecar.verify", "kvxfer.sidecar.keepalive", "kvxfer.sidecar.engines",
        "kvxfer.sidecar.claim", "kvxfer.control.local", "kvxfer.sidecar.stage_server",
        "kvxfer.sidecar.staged_reads", "kvxfer.sidecar.staged_windows", "kvxfer.sidecar.stall_guard",
        "kvxfer.sidecar.engine_rings", "kvxfer.sidecar.stream_server", "kvxfer.sidecar.stream_feed",
        "kvxfer.sidecar.recv_state",
    ]),
    ("engine side: the client and the vLLM connector", ["kvxfer.client", "kvxfer.engine_ring",
                                                         "kvxfer.connector*"]),
    ("app: the daemon, built in order", ["kvxfer.sidecar", "kvxfer.sidecar.operations",
                                         "kvxfer.sidecar.app"]),
    ("harness: synthetic engines, demo, benchmarks", ["kvxfer.testing*"]),
    ("control plane and CLI", ["kvxfer.control", "kvxfer.control.access", "kvxfer.control.service",
                               "kvxfer.control.client_cli", "kvxfer.serve",
                               "kvxfer.cli", "kvxfer.__main__"]),
]

# the engine side never loads the daemon (nor NIXL's owner, nor its peers' code)
ENGINE_SIDE = ("kvxfer.client", "kvxfer.connector")
DAEMON_ONLY = ("kvxfer.sidecar", "kvxfer.observe", "kvxfer.status", "kvxfer.serve", "kvxfer.control",
               "kvxfer.testing")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (ROOT / "kvxfer").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The kvxfer modules a file imports, wherever the import statement sits."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in known}


def layer_of(module: str) -> int | None:
    for i, (_name, patterns) in enumerate(LAYERS):
        for pat in patterns:
            if module == pat or (pat.endswith("*") and (module == pat[:-1] or module.startswith(pat[:-1]))):
                return i
    return None


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(path, known) - {name} for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"place these modules in tests/test_layers.py LAYERS: {unplaced}"


def test_no_lower_layer_imports_a_higher_one() -> None:
    wrong = []
    for mod, deps in sorted(graph().items()):
        mine = layer_of(mod)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if mine is not None and theirs is not None and theirs > mine:
                wrong.append(f"{mod} ({LAYERS[mine][0].split(':')[0]}) imports {dep} "
                             f"({LAYERS[theirs][0].split(':')[0]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_engine_side_never_imports_the_daemon() -> None:
    wrong = [f"{mod} imports {dep}" for mod, deps in sorted(graph().items())
             if mod.startswith(ENGINE_SIDE) for dep in sorted(deps) if dep.startswith(DAEMON_ONLY)]
    assert not wrong, "\n".join(wrong)


def test_only_the_cli_imports_the_harness() -> None:
    wrong = [f"{mod} imports {dep}" for mod, deps in sorted(graph().items())
             if not mod.startswith("kvxfer.testing") and mod != "kvxfer.cli"
             for dep in sorted(deps) if dep.startswith("kvxfer.testing")]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("edges", "cycle"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"a2"}, "a2": set(), "b": {"b"}}, True),
])
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], cycle: bool) -> None:
    assert (find_cycle(edges) is not None) is cycle


def test_the_walk_sees_imports_inside_functions_and_type_checking(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvxfer.a import X\n"
                   "def f():\n    import kvxfer.b\n    from kvxfer import c\n")
    assert imports(src, {"kvxfer.a", "kvxfer.b", "kvxfer.c", "kvxfer.d"}) == {"kvxfer.a", "kvxfer.b",
                                                                              "kvxfer.c"}
