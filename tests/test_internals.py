"""docs/internals.md stays a true map: every module on a floor, imports going down, real files.

When a test here fails because a module was added, moved or removed, fix the page, not the
test: add a row for the new module (``| `name.py` | what it holds |``, or
``| `package/name.py` | ... |`` inside a subpackage) to the table of the floor it belongs to,
under "## The floors" in docs/internals.md; a new floor is a new "### " heading there, placed
above the floors it imports from.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "tierchain"
PAGE = ROOT / "docs" / "internals.md"

# (importer, imported): imports from a floor above the importer's own that the page names as
# not yet fixed. Remove a line here once the code no longer needs it.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match is not None, f"docs/internals.md has no '## {heading}' section"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every Markdown table in ``text`` (not the headers), as lists of cells."""
    rows: list[list[str]] = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        separator = n + 1 < len(lines) and re.fullmatch(r"\|[-:| ]+\|", lines[n + 1].strip())
        if not line.startswith("|") or separator or re.fullmatch(r"\|[-:| ]+\|", line.strip()):
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def floors() -> list[tuple[str, list[str]]]:
    """The floors, top first: each heading with the modules its table names."""
    text = section(PAGE.read_text(), "The floors")
    found = []
    for part in re.split(r"^### ", text, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        modules = [
            m.group(1)
            for row in table_rows(body)
            if (m := re.fullmatch(r"`([\w/]+\.py)`", row[0])) is not None
        ]
        found.append((heading.strip(), modules))
    return found


def package_modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}


def test_the_map_has_floors_and_each_names_modules():
    found = floors()
    assert len(found) >= 4
    assert all(modules for _, modules in found), found


def test_every_module_of_the_package_is_on_one_floor_of_the_map():
    named = [m for _, modules in floors() for m in modules]
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"docs/internals.md puts these modules on more than one floor: {twice}"
    missing = sorted(package_modules() - set(named))
    assert not missing, (
        f"docs/internals.md does not name {missing}: add a row for each to the table of its "
        "floor under '## The floors' (see this test module's docstring)"
    )
    gone = sorted(set(named) - package_modules())
    assert not gone, f"docs/internals.md names modules that no longer exist: {gone}"


def module_file(dotted: str) -> str | None:
    """``tierchain.a.b`` -> ``a/b.py`` (or ``a/b/__init__.py``), if it is one of ours."""
    parts = dotted.split(".")
    if parts[0] != "tierchain":
        return None
    path = Path(*parts[1:]) if len(parts) > 1 else Path()
    candidates = [path / "__init__.py"]
    if path.name:
        candidates.insert(0, path.parent / f"{path.name}.py")
    for candidate in candidates:
        if (PACKAGE / candidate).is_file():
            return candidate.as_posix()
    return None


def imports_of(path: Path, tree: ast.AST | None = None) -> set[str]:
    """The package's modules that ``path`` imports (at the top or inside a function), or those
    ``tree`` (a part of it) imports."""
    here = ["tierchain", *path.relative_to(PACKAGE).parent.parts]  # the importer's package
    found: set[str] = set()
    for node in ast.walk(tree if tree is not None else ast.parse(path.read_text())):
        dotted: list[str] = []
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{module}.{alias.name}" for alias in node.names]
            # ``from . import name`` imports the names (each may be a module), not the package.
            dotted = [module, *names] if node.module else names
        for name in dotted:
            file = module_file(name)
            if file is not None:
                found.add(file)
    return found


def test_the_import_resolver_sees_relative_absolute_and_package_imports():
    assert "config.py" in imports_of(PACKAGE / "stack.py")  # from .config import ...
    assert "watchdog.py" in imports_of(PACKAGE / "misconfig.py")  # inside a function
    assert "watchdog.py" not in module_level_imports_of(PACKAGE / "misconfig.py")
    assert "_types.py" in imports_of(PACKAGE / "admin" / "page.py")  # from .._types import ...
    assert "admin/session.py" in imports_of(PACKAGE / "admin" / "app.py")


def test_no_module_imports_from_a_floor_above_its_own():
    level = {m: n for n, (_, modules) in enumerate(floors()) for m in modules}
    upward = sorted(
        (module, imported)
        for module in package_modules()
        if module in level
        for imported in imports_of(PACKAGE / module)
        if imported in level and level[imported] < level[module]
    )
    unexpected = [pair for pair in upward if pair not in ALLOWED_UPWARD]
    assert not unexpected, (
        f"these imports go up a floor of docs/internals.md: {unexpected}; move a module to the "
        "floor it belongs to, or break the import"
    )
    fixed = sorted(ALLOWED_UPWARD - set(upward))
    assert not fixed, f"no longer imported: remove {fixed} from ALLOWED_UPWARD and the page"


def module_level_imports_of(path: Path) -> set[str]:
    """The package's modules that ``path`` imports when it is imported: the statements at the
    top of the module (not in a function, not under ``if TYPE_CHECKING``)."""
    top = ast.Module(
        body=[
            n
            for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.Import | ast.ImportFrom)
        ],
        type_ignores=[],
    )
    return imports_of(path, tree=top)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (each a circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while True:
                other = stack.pop()
                part.append(other)
                if other == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph(*, module_level: bool) -> dict[str, set[str]]:
    read = module_level_imports_of if module_level else imports_of
    return {m: read(PACKAGE / m) - {m} for m in package_modules()}


def test_the_circle_finder_finds_a_circle():
    assert circles({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"}}) == [
        ["a.py", "b.py", "c.py"]
    ]


def test_no_two_modules_import_each_other_when_the_package_is_imported():
    assert circles(import_graph(module_level=True)) == []


def test_the_imports_make_no_circle_even_inside_functions():
    # Counting the imports inside functions and under TYPE_CHECKING: config.py reads and
    # checks, stack.py builds from it, and config never reaches back up to the stack (the old
    # path tierchain.config.build_stack is put there by the package's __init__).
    assert "stack.py" not in imports_of(PACKAGE / "config.py")
    assert circles(import_graph(module_level=False)) == []


def test_the_routes_file_parser_uses_only_public_names_of_backend():
    tree = ast.parse((PACKAGE / "routes_file.py").read_text())
    taken = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "backend"
        for alias in node.names
    }
    assert taken
    assert not [name for name in taken if name.startswith("_")], taken
    private = sorted(
        (module, alias.name)
        for module in package_modules()
        for node in ast.walk(ast.parse((PACKAGE / module).read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "backend"
        for alias in node.names
        if alias.name.startswith("_")
    )
    assert not private, f"private names of backend.py imported: {private}"


def test_the_old_path_of_build_stack_is_the_stacks_own():
    import tierchain.config
    import tierchain.stack

    assert tierchain.config.build_stack is tierchain.stack.build_stack


@pytest.mark.parametrize("module", ["config", "stack", "identity", "routes_file"])
def test_each_module_of_the_old_circle_imports_first_in_a_fresh_interpreter(module):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", f"import tierchain.{module}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def where_rows() -> list[tuple[str, list[str], list[str]]]:
    text = section(PAGE.read_text(), "Where do I change X")
    rows = []
    for row in table_rows(text):
        assert len(row) == 3, f"a row of 'Where do I change X' has {len(row)} cells: {row}"
        paths = [p for p in re.findall(r"`([^`]+)`", row[1]) if re.search(r"\.(py|md)$", p)]
        names = re.findall(r"`([^`]+)`", row[2])
        rows.append((row[0], paths, names))
    return rows


def test_the_where_do_i_change_table_has_rows():
    assert len(where_rows()) >= 20


@pytest.mark.parametrize("row", where_rows(), ids=lambda row: row[0][:40])
def test_each_where_do_i_change_row_names_files_that_exist_and_hold_what_it_says(row):
    what, paths, names = row
    assert paths, f"the row {what!r} names no file"
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"the row {what!r} names files that do not exist: {missing}"
    assert names, f"the row {what!r} says nothing to look for"
    text = "".join((ROOT / p).read_text() for p in paths)
    absent = [name for name in names if name not in text]
    assert not absent, f"the row {what!r}: {absent} not found in {paths}"


def test_each_private_part_of_another_package_names_a_real_module_that_says_so():
    text = section(PAGE.read_text(), "Private parts of other packages")
    wheres = [row[0] for row in table_rows(text)]
    assert len(wheres) >= 5
    for where in wheres:
        module = re.match(r"`([\w/]+\.py)`", where)
        assert module is not None, where
        path = module.group(1)
        file = ROOT / path if path.startswith("tests/") else PACKAGE / path
        assert file.is_file(), where
        source = file.read_text()
        assert "docs/internals.md" in source, f"{where}: no comment at the use site points here"


def timer_calls(tree: ast.AST) -> bool:
    """A loop timer armed by hand: ``loop.call_later(...)`` or ``loop.call_at(...)``."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in {"call_later", "call_at"}
        for n in ast.walk(tree)
    )


def is_text(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def cancellation_by_hand(tree: ast.AST) -> bool:
    """``task.cancel("a reason")``, ``task.uncancel()`` or ``task.cancelling()`` (a timer
    entry's ``cancel(entry)`` is not one)."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and (
            n.func.attr in {"uncancel", "cancelling"}
            or (n.func.attr == "cancel" and n.args and is_text(n.args[0]))  # with a message
        )
        for n in ast.walk(tree)
    )


_COROUTINE_STATE = {"cr_frame", "cr_running", "cr_await", "cr_suspended", "getcoroutinestate"}


def coroutines_by_hand(tree: ast.AST) -> bool:
    """``coro.send``/``coro.throw`` on a coroutine, or a look at its state (``cr_frame``,
    ``cr_running``, ``cr_await``, ``inspect.getcoroutinestate``...)."""
    return any(
        (
            isinstance(n, ast.Attribute)
            and (
                n.attr in _COROUTINE_STATE
                or (
                    n.attr in {"send", "throw"}
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "coro"
                )
            )
        )
        or (isinstance(n, ast.ImportFrom) and any(a.name in _COROUTINE_STATE for a in n.names))
        for n in ast.walk(tree)
    )


_CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"}


def clock_reads(tree: ast.AST) -> bool:
    """A monotonic clock read directly: ``time.monotonic()``, ``time.perf_counter()``, or
    ``from time import monotonic`` (every layer reads ``clock.now()``)."""
    return any(
        (
            isinstance(n, ast.Attribute)
            and n.attr in _CLOCKS
            and isinstance(n.value, ast.Name)
            and n.value.id == "time"
        )
        or (
            isinstance(n, ast.ImportFrom)
            and n.module == "time"
            and any(a.name in _CLOCKS for a in n.names)
        )
        for n in ast.walk(tree)
    )


def subclasses_interruption(tree: ast.AST) -> bool:
    """A class that inherits ``Interruption``: layers hold one (composition), so the
    runtime's fields (the task, its baseline) stay the runtime's."""
    return any(
        isinstance(n, ast.ClassDef)
        and any(
            (isinstance(base, ast.Name) and base.id == "Interruption")
            or (isinstance(base, ast.Attribute) and base.attr == "Interruption")
            for base in n.bases
        )
        for n in ast.walk(tree)
    )


ROOM = "_runtime/"


@pytest.mark.parametrize(
    "check",
    [timer_calls, cancellation_by_hand, coroutines_by_hand, clock_reads],
    ids=lambda f: f.__name__,
)
def test_nothing_outside_the_runtime_room_touches_timers_cancellation_or_coroutines(check):
    # The seam: loop timers, cancel-with-a-reason and its undoing, and coroutines driven by
    # hand live in src/tierchain/_runtime/ only; every layer goes through its plain names.
    outside = sorted(
        module
        for module in package_modules()
        if not module.startswith(ROOM) and check(ast.parse((PACKAGE / module).read_text()))
    )
    assert not outside, f"{check.__name__} outside {ROOM}: {outside}"
    inside = [m for m in package_modules() if m.startswith(ROOM)]
    assert any(check(ast.parse((PACKAGE / m).read_text())) for m in inside)  # the check sees it


def test_the_seam_checks_see_what_they_look_for():
    assert timer_calls(ast.parse("loop.call_at(1.0, f)"))
    assert cancellation_by_hand(ast.parse("task.uncancel()"))
    assert cancellation_by_hand(ast.parse("task.cancel('tierchain: why')"))
    assert not cancellation_by_hand(ast.parse("deadlines.cancel(entry)"))
    assert coroutines_by_hand(ast.parse("coro.send(None)"))
    assert coroutines_by_hand(ast.parse("frame = c.cr_frame"))
    assert coroutines_by_hand(ast.parse("inspect.getcoroutinestate(c) != CLOSED"))
    assert coroutines_by_hand(ast.parse("from inspect import getcoroutinestate"))
    assert coroutines_by_hand(ast.parse("busy = c.cr_running"))
    assert clock_reads(ast.parse("now = time.monotonic()"))
    assert clock_reads(ast.parse("from time import perf_counter"))
    assert not clock_reads(ast.parse("now = clock.now()"))
    assert not clock_reads(ast.parse("expiry = clock.wall() + ttl"))
    assert subclasses_interruption(ast.parse("class _Watch(Interruption): pass"))
    assert subclasses_interruption(ast.parse("class G(interrupt.Interruption): pass"))
    assert not subclasses_interruption(ast.parse("class _Watch:\n    cut: Interruption"))


def test_no_layer_inherits_the_runtimes_interruption():
    # Budget's _Spend, the watchdog's _Watch and the DisconnectGuard hold an Interruption
    # (``cut``); the room defines it, and only the room may extend it.
    outside = sorted(
        module
        for module in package_modules()
        if not module.startswith(ROOM)
        and subclasses_interruption(ast.parse((PACKAGE / module).read_text()))
    )
    assert not outside, f"Interruption subclassed outside {ROOM}: {outside}"


def test_a_deadline_handle_is_a_typed_object_not_a_list():
    # What schedule() returns is the room's own Deadline (named fields, slots), which the
    # layers only hand back to cancel() and due() (mypy, strict, refuses an index into it).
    from tierchain._runtime import deadlines

    assert isinstance(deadlines.Deadline, type)
    assert not issubclass(deadlines.Deadline, list | tuple)
    assert set(deadlines.Deadline.__slots__) == {"due", "seq", "callback", "context", "pending"}
    source = (PACKAGE / "_runtime" / "deadlines.py").read_text()
    assert not re.search(r"^Deadline\s*=", source, re.M)  # a class, not an alias of a list


def test_one_timer_queue_arms_every_loop_timer_of_the_package():
    # One scheduler per event loop (_runtime/deadlines.py) holds every deadline, the
    # disconnect guards' watch, every stream's keepalive and the lag monitor's tick.
    arming = sorted(
        m for m in package_modules() if timer_calls(ast.parse((PACKAGE / m).read_text()))
    )
    assert arming == ["_runtime/deadlines.py"]


def test_one_tolerance_for_a_timer_that_fires_early():
    # The scheduler's EARLY is the only one: no module defines a tolerance of its own.
    tolerances = sorted(
        m
        for m in package_modules()
        if re.search(
            r"^_?(EARLY|SLACK|QUANTUM)\s*=|_clock_resolution|def slack\(",
            (PACKAGE / m).read_text(),
            re.M,
        )
    )
    assert tolerances == ["_runtime/deadlines.py"]


# -- one request's path: what each layer reads and writes on the per-request object ---------

LAYER_MODULES = {
    "Heartbeats": "heartbeats.py",
    "Budget": "budget.py",
    "PreferBackend": "prefer.py",
    "Failover": "failover/",  # a package: what its modules read and write, together
    "Breaker": "breaker.py",
    # the middleware and the modules of its own (one attempt's watch, its verdicts said)
    "SaturationWatchdog": "watchdog.py watch.py verdicts.py",
    "Forwarder": "forwarder.py",
}


def request_fields() -> set[str]:
    from tierchain.request import TierRequest

    return {name for name in TierRequest.__slots__ if not name.startswith("_")}


def uses_of_the_request(module: str) -> tuple[set[str], set[str], bool]:
    """(fields read, fields written or appended to, whether it emits) by ``module`` (a
    package: ``name/``, all its modules; or several modules, separated by spaces), on
    expressions named ``req`` or ``<something>.req``."""
    if module.endswith("/"):
        files = sorted((PACKAGE / module).glob("*.py"))
    else:
        files = [PACKAGE / name for name in module.split()]
    tree = ast.Module(body=[ast.parse(f.read_text()) for f in files], type_ignores=[])
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    fields = request_fields()
    reads: set[str] = set()
    writes: set[str] = set()
    emits = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = ast.unparse(node.value)
        if owner != "req" and not owner.endswith(".req"):
            continue
        parent = parents.get(node)
        if node.attr == "emit" and isinstance(parent, ast.Call):
            emits = True
        if node.attr not in fields:
            continue
        appended = isinstance(parent, ast.Attribute) and parent.attr == "append"
        (writes if isinstance(node.ctx, ast.Store) or appended else reads).add(node.attr)
    return reads, writes, emits


def path_rows() -> dict[str, tuple[set[str], set[str], bool]]:
    """Layer -> (fields its row reads, fields it writes, whether the row says it emits)."""
    text = section(PAGE.read_text(), "One request's path")
    fields = request_fields()
    rows = {}
    for layer, read, write, _ends in (row for row in table_rows(text) if len(row) == 4):
        written_part = write.split("emits")[0]

        def named(cell: str) -> set[str]:
            # `attempt_error = None` names attempt_error; `when_all_open="..."` no field
            found = {re.split(r"\W", name)[0] for name in re.findall(r"`([^`]+)`", cell)}
            return found & fields

        rows[layer] = (named(read), named(written_part), "emits" in write)
    return rows


def test_the_path_table_has_a_row_for_every_layer():
    assert set(path_rows()) == set(LAYER_MODULES)


@pytest.mark.parametrize("layer", sorted(LAYER_MODULES))
def test_the_path_table_says_what_each_layer_reads_and_writes_on_the_request(layer):
    said_reads, said_writes, said_emits = path_rows()[layer]
    reads, writes, emits = uses_of_the_request(LAYER_MODULES[layer])
    assert said_writes == writes, (
        f"docs/internals.md says {layer} writes {sorted(said_writes)}; "
        f"{LAYER_MODULES[layer]} writes {sorted(writes)}"
    )
    assert said_reads <= reads, f"{layer} does not read {sorted(said_reads - reads)}"
    unsaid = (reads - writes) - said_reads
    assert not unsaid, f"docs/internals.md does not say {layer} reads {sorted(unsaid)}"
    assert said_emits == emits, f"{layer}: the page and the code disagree on whether it emits"


LONG = 600  # lines: "about 600" (docs/internals.md, modules over 600 lines)


def test_every_module_over_600_lines_says_why_in_the_map():
    named = {
        m.group(1)
        for row in table_rows(section(PAGE.read_text(), "Modules over 600 lines"))
        if (m := re.fullmatch(r"`([\w/]+\.py)`", row[0])) is not None
    }
    long = {m for m in package_modules() if len((PACKAGE / m).read_text().splitlines()) > LONG}
    assert not long - named, (
        f"over {LONG} lines with no reason in docs/internals.md: {long - named}"
    )
    assert not named - long, f"no longer over {LONG} lines: remove {named - long} from the table"


TOO_LONG = 800  # lines of a module, reason or not
LONGEST_FUNCTION = 80  # lines of a function or method, from its def to its last line


def test_no_module_is_over_800_lines():
    sizes = {m: len((PACKAGE / m).read_text().splitlines()) for m in package_modules()}
    over = {m: n for m, n in sizes.items() if n > TOO_LONG}
    assert not over, f"over {TOO_LONG} lines: split these by job: {over}"


def functions_over(limit: int, module: str) -> list[tuple[str, int]]:
    """Each function or method of ``module`` longer than ``limit`` lines, with its length."""
    tree = ast.parse((PACKAGE / module).read_text())
    return [
        (f"{module}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_function_length_check_sees_a_long_function():
    assert functions_over(10, "config.py")  # from_env's steps are longer than 10 lines


def test_no_function_is_over_80_lines():
    over = [f for m in sorted(package_modules()) for f in functions_over(LONGEST_FUNCTION, m)]
    assert not over, f"over {LONGEST_FUNCTION} lines: split these into named steps: {over}"


# -- copies kept for speed ---------------------------------------------------------------

_COPY = re.compile(r"#.*, inline\b")


def copies_in_code() -> dict[str, int]:
    """Module (as the tables write it) -> how many comments mark a copy in it."""
    counts: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        marks = sum(1 for line in path.read_text().splitlines() if _COPY.search(line))
        if marks:
            counts[path.relative_to(PACKAGE).as_posix()] = marks
    return counts


def copies_in_docs() -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in table_rows(section(PAGE.read_text(), "Copies kept for speed")):
        module = row[0].strip("` ")
        counts[module] = counts.get(module, 0) + 1
    return counts


def test_every_copy_of_a_rule_is_listed_with_its_original_and_every_listed_copy_exists():
    assert copies_in_code() == copies_in_docs()


def test_only_the_per_chunk_path_keeps_a_copy_for_good():
    kept = section(PAGE.read_text(), "Copies kept for speed").split("### ")[0]
    rows = table_rows(kept)
    assert rows, "the table of copies kept for speed is empty"
    for row in rows:
        assert "every chunk" in row[3], f"{row[0]}: a copy kept off the per-chunk path"
        assert re.search(r"\d", row[4]), f"{row[0]}: a copy kept without its measured gain"


# -- every module with behaviour of its own has a test module -----------------------------


def own_test_module(module: str) -> Path | None:
    """``tests/test_<name>.py`` for ``module`` (``a/b.py`` -> ``test_b.py`` or ``test_a_b.py``;
    a leading ``_`` dropped; a package's ``__init__.py`` is the package), if there is one."""
    parts = module.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts:
        return None  # the package's own __init__.py: its row names its test module
    names = [p.lstrip("_") for p in parts]
    for candidate in (names[-1], "_".join(names)):
        path = ROOT / "tests" / f"test_{candidate}.py"
        if path.is_file():
            return path
    return None


def where_tested() -> dict[str, str]:
    """The rows of '## Test modules': module -> where it is tested."""
    rows = table_rows(section(PAGE.read_text(), "Test modules"))
    found: dict[str, str] = {}
    for row in rows:
        match = re.fullmatch(r"`([\w/]+\.py)`", row[0])
        assert match is not None, f"a row of '## Test modules' names no module: {row}"
        assert match.group(1) not in found, f"'## Test modules' names {match.group(1)} twice"
        found[match.group(1)] = row[1]
    return found


def defined_names(module: str) -> set[str]:
    """The names ``module`` defines at its top level (classes, functions, constants)."""
    tree = ast.parse((PACKAGE / module).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("__")}


def test_every_module_with_behaviour_has_a_test_module_or_a_row_saying_where_it_is_tested():
    rows = where_tested()
    missing = sorted(m for m in package_modules() if own_test_module(m) is None and m not in rows)
    assert not missing, (
        f"no tests/test_<name>.py for {missing}: write one, or add a row to '## Test modules' "
        "in docs/internals.md naming the test modules that cover it (`none:` and a reason for a "
        "module with no behaviour of its own)"
    )
    gone = sorted(m for m in rows if m not in package_modules())
    assert not gone, f"'## Test modules' names modules that no longer exist: {gone}"
    own = sorted(m for m in rows if own_test_module(m) is not None)
    assert not own, f"these have a test module of their own now; drop their rows: {own}"


@pytest.mark.parametrize("module", sorted(where_tested()))
def test_a_row_of_the_test_modules_names_test_modules_that_use_the_module(module):
    where = where_tested()[module]
    if where.startswith("none:"):
        assert where.removeprefix("none:").strip(), f"{module}: 'none:' needs its reason"
        return
    # each `tests/test_x.py`, with what it reaches the module through: (through `Name`)
    files = re.findall(r"`(tests/test_\w+\.py)`(?: \(through `([^`]+)`\))?", where)
    assert files, f"{module}: the row names no test module: {where!r}"
    dotted = "tierchain." + module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    names = defined_names(module)
    for file, through in files:
        path = ROOT / file
        assert path.is_file(), f"{module}: {file} does not exist"
        text = path.read_text()
        used = dotted in text or any(re.search(rf"\b{re.escape(n)}\b", text) for n in names)
        assert used or (through and through in text), (
            f"{module}: {file} names neither the module, nor anything it defines, nor its "
            "'through' name"
        )


def test_no_per_request_copy_is_left_to_take_back():
    """The per-request copies an earlier speed pass left are all taken back: the list of
    copies "not yet taken back" has no row, and every copy in the code is one kept for
    speed on the per-chunk path (its row is in the table above that list)."""
    copies = section(PAGE.read_text(), "Copies kept for speed")
    kept, _, not_yet = copies.partition("### Copies not yet taken back")
    assert not table_rows(not_yet), "a per-request copy is left: take it back"
    listed: dict[str, int] = {}
    for row in table_rows(kept):
        module = row[0].strip("` ")
        listed[module] = listed.get(module, 0) + 1
    assert copies_in_code() == listed


def test_every_object_is_set_up_by_its_own_init():
    """No object is made without its ``__init__`` and filled in by its caller (the speed
    pass's ``object.__new__``): a class's fields are where its ``__init__`` says."""
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "object.__new__" in line or re.search(r"\b\w+\.__new__\(", line)
    ]
    assert not found, f"objects made without their __init__: {found}"
