"""Which loads and stores of a kernel its blocks index without a mask, read from its source.

A smaller tile computes the same result only where every element a tile reaches past the data is masked: a
``tl.load``/``tl.store`` (or atomic) whose address is built from a ``tl.arange`` over a tile, or a block pointer
whose block shape is the tile, must carry ``mask=`` or ``boundary_check=``. :func:`unmasked` reads the kernel's body
and the ``@triton.jit`` functions it calls (resolved as Triton resolves them, :mod:`smemguard.kernels.source`)
and lists each access that carries neither, with the parameters whose blocks index it. The reading leans to
"unmasked": a value computed from an indexed one is indexed (through assignments, calls and a callee's return),
both branches of an ``if`` count unless its test reads only a callee's parameter given a literal (or left to its
default: ``if MASK_BLOCK_TABLE:``, ``if check is not None:``), and a jit function that cannot be read counts as an
unmasked access of whatever it is passed. A library pack reads it for the tiles its safety argument changes
(:class:`smemguard.patches.Kernels`); nothing here runs on the launch path.
"""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass, field

from .parameters import block_shape_arguments
from .source import Scope, is_jit

log = logging.getLogger(__name__)

# What a value depends on, as (kind, parameter): a block the parameter sizes indexes it, or the parameter's own
# value flows into it (what a caller passed for it decides, see _Reader.mapped).
_INDEXED, _PASSED = "indexed", "passed"
#: Where the mask is among the positional arguments, per kind of access; ``boundary_check`` is the fourth of both.
_MASK_AT = {"load": 1, "store": 2, "atomic": 2}
_BOUNDARY_CHECK_AT = 3
#: The values of a literal argument (``MASK_BLOCK_TABLE=True``, ``boundary_check=(0, 1)``) a callee's branches are
#: read under.
_LITERALS = (bool, int, float, str, type(None), tuple)
_NOT_LITERAL = object()


@dataclass(frozen=True)
class Access:
    """A load or store that no mask covers: where it is, and the parameters whose blocks index its address."""

    function: str
    line: int
    tiles: frozenset

    def text(self) -> str:
        return f"{self.function} line {self.line} (indexed by {', '.join(sorted(self.tiles))})"


@dataclass
class _Facts:
    unmasked: list = field(default_factory=list)  # (function, line, dependencies)
    returns: set = field(default_factory=set)  # what the function's return values depend on


def unmasked(jit) -> tuple[Access, ...] | None:
    """Every load and store of ``jit`` that a block of its parameters indexes and no mask covers; None when its
    source cannot be read."""
    try:
        kernel = Scope.of(jit)
        facts = _read(kernel, {}) if kernel is not None else None
    except Exception:  # an unreadable kernel proves nothing
        log.debug("smemguard: cannot read the loads and stores of %s", getattr(jit, "__name__", jit), exc_info=True)
        return None
    if facts is None:
        return None
    found: dict[tuple[str, int], frozenset] = {}
    for function, line, dependencies in facts.unmasked:
        tiles = frozenset(name for kind, name in dependencies if kind == _INDEXED)
        if tiles:
            found[(function, line)] = found.get((function, line), frozenset()) | tiles
    return tuple(Access(function, line, tiles) for (function, line), tiles in sorted(found.items()))


def _read(scope: Scope, constants: dict) -> _Facts:
    reader = _Reader(scope, constants)
    for statement in scope.source.function.body:
        reader.visit(statement)
    return reader.facts


def _literal(node: ast.expr):
    """The value of a literal argument, else :data:`_NOT_LITERAL`."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return _NOT_LITERAL
    return value if _hashable_literal(value) else _NOT_LITERAL


def _hashable_literal(value) -> bool:
    """A literal a callee's branches may be read under (hashable: it keys what the callee is read under)."""
    try:
        hash(value)
    except TypeError:
        return False
    return isinstance(value, _LITERALS)


def _access_kind(callee) -> str | None:
    import triton.language as tl

    if callee is tl.load:
        return "load"
    if callee is tl.store:
        return "store"
    name = getattr(callee, "__name__", "")
    return "atomic" if name.startswith("atomic_") and getattr(tl, name, None) is callee else None


def _absent(node: ast.expr | None) -> bool:
    """No mask: not given, ``None`` or ``()``."""
    return node is None or (isinstance(node, ast.Constant) and node.value is None) or \
        (isinstance(node, ast.Tuple) and not node.elts)


def _masked(call: ast.Call, kind: str) -> bool:
    given = {keyword.arg: keyword.value for keyword in call.keywords}
    for name, position in (("mask", _MASK_AT[kind]), ("boundary_check", _BOUNDARY_CHECK_AT)):
        node = given.get(name, call.args[position] if len(call.args) > position else None)
        if not _absent(node):
            return True
    return False


class _Reader(ast.NodeVisitor):
    """One pass over a function body: what each local value depends on, and every access no mask covers."""

    def __init__(self, scope: Scope, constants: dict) -> None:
        self.scope, self.constants = scope, constants
        self.line_offset = scope.source.line_offset
        self.name = scope.name
        self.values: dict[str, set] = {name: {(_PASSED, name)} for name in scope.source.params}
        self.facts = _Facts()
        self.callees: dict[tuple, _Facts] = {}

    # -- values -----------------------------------------------------------------------------------

    def dependencies(self, node: ast.expr) -> set:
        """What the value of ``node`` depends on."""
        found: set = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                found |= self.values.get(sub.id, set())
            elif isinstance(sub, ast.Call):
                found |= self.call_value(sub)
        return found

    def call_value(self, call: ast.Call) -> set:
        """What a call's value depends on beyond its arguments: the blocks it sizes, or a jit callee's return."""
        callee = self.scope.resolve(call.func)
        sizing = block_shape_arguments(callee, call)
        if sizing:
            return {(_INDEXED, name) for argument in sizing for _, name in self.dependencies(argument)}
        read = self.callee(callee, call) if is_jit(callee) else None
        if read is None:
            return set()
        facts, passed = read
        return self.mapped(facts.returns, passed)

    def bind(self, target: ast.expr, dependencies: set) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):  # a name assigned in a loop or a branch keeps every value it may hold
                self.values[node.id] = self.values.get(node.id, set()) | dependencies

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        dependencies = self.dependencies(node.value)
        for target in node.targets:
            self.bind(target, dependencies)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if node.value is not None:
            self.bind(node.target, self.dependencies(node.value))

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.generic_visit(node)
        self.bind(node.target, self.dependencies(node.value))

    def visit_For(self, node: ast.For) -> None:
        self.bind(node.target, self.dependencies(node.iter))
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        self.generic_visit(node)
        if node.value is not None:
            self.facts.returns |= self.dependencies(node.value)

    def visit_If(self, node: ast.If) -> None:
        taken = self.constant_test(node.test)
        if taken is None:
            self.generic_visit(node)
            return
        for statement in node.body if taken else node.orelse:
            self.visit(statement)

    def constant_test(self, test: ast.expr) -> bool | None:
        """The outcome of an ``if`` test on a parameter given a literal; None when it is not one."""
        if isinstance(test, ast.Name) and test.id in self.constants:
            return bool(self.constants[test.id])
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self.constant_test(test.operand)
            return None if inner is None else not inner
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id in self.constants \
                and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
            return (self.constants[test.left.id] is None) == isinstance(test.ops[0], ast.Is)
        return None

    def visit_FunctionDef(self, node) -> None:
        pass  # a nested function is not what Triton compiles

    visit_Lambda = visit_FunctionDef

    # -- accesses ---------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        callee = self.scope.resolve(node.func)
        kind = _access_kind(callee)
        line = self.line_offset + node.lineno
        if kind is not None and not _masked(node, kind):
            pointer = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "pointer"), None)
            if pointer is not None:
                self.facts.unmasked.append((self.name, line, self.dependencies(pointer)))
        elif is_jit(callee):
            read = self.callee(callee, node)
            if read is None:  # unread: whatever it is passed may be accessed unmasked
                passed = [*node.args, *(keyword.value for keyword in node.keywords)]
                self.facts.unmasked.append((getattr(callee, "__name__", "?"), line,
                                            set().union(*map(self.dependencies, passed)) if passed else set()))
            else:
                facts, passed = read
                for function, callee_line, dependencies in facts.unmasked:
                    self.facts.unmasked.append((function, callee_line, self.mapped(dependencies, passed)))
        self.generic_visit(node)

    # -- jit callees ------------------------------------------------------------------------------

    def callee(self, jit, call: ast.Call) -> tuple[_Facts, dict] | None:
        """What a jit callee does with what ``call`` passes it, and what it passes by parameter; None when the callee
        cannot be read (or is not followed, :meth:`Scope.enter`)."""
        try:
            entered = self.scope.enter(jit, call)
            facts = self.read(entered) if entered is not None else None
        except Exception:
            log.debug("smemguard: cannot read %s", getattr(jit, "__name__", jit), exc_info=True)
            return None
        return (facts, entered.passed) if facts is not None else None

    def read(self, callee: Scope) -> _Facts:
        """The facts of a callee, its branches on the literals its call gives (or leaves to their defaults) taken as
        they are: read once per literals."""
        constants = {name: value for name, value in callee.defaults.items() if _hashable_literal(value)}
        for name, value in callee.passed.items():
            constants.pop(name, None)
            literal = _literal(value)
            if literal is not _NOT_LITERAL:
                constants[name] = literal
        key = (id(callee.jit), tuple(sorted(constants.items())))
        if key not in self.callees:
            self.callees[key] = _read(callee, constants)
        return self.callees[key]

    def mapped(self, dependencies: set, passed: dict) -> set:
        """A callee's dependencies, on its parameters, as this function's: what it passed for them."""
        found: set = set()
        for kind, name in dependencies:
            value = passed.get(name)
            if value is None:
                continue
            ours = self.dependencies(value)
            found |= ours if kind == _PASSED else {(_INDEXED, parameter) for _, parameter in ours}
        return found
