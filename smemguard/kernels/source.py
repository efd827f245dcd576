"""The one reader of a Triton kernel's Python source: its text, its parsed function, and the calls it makes into
other ``@triton.jit`` functions.

:func:`parsed` reads a JIT function's source once (:func:`source_of`: the text Triton compiles, with the file line it
starts at) and keeps the function it defines, its parameters and the names its body binds. A :class:`Scope` is one
JIT function as a kernel reaches it: the kernel itself, or a function it calls with each parameter bound to the
argument the call passed. :meth:`Scope.callee` is the one way to follow a call: the name resolved as Triton resolves
it (closure, then globals, then builtins), at most :data:`MAX_DEPTH` calls below the kernel, never back into a
function already on the chain. What a kernel's parameters do (:mod:`.parameters`), which of its accesses no mask
covers (:mod:`.tails`) and which parameters are pointers and unit strides (``smemguard.preflight.source``) are all
read through it; nothing here runs on the launch path.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from collections import deque
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterator

#: Called jit functions followed below a kernel; a deeper call is read as one that cannot be followed.
MAX_DEPTH = 8


class ByIdentity:
    """What was computed for an object, kept by the object's identity and with the object (so that its id is not
    reused while the entry lives), the oldest dropped past ``size`` entries. Not keyed by the object itself:
    hashing a ``JITFunction`` computes its cache key, which fails on one Inductor unpickled from its FX graph
    cache (its hash lock is gone)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: dict[int, tuple[Any, Any]] = {}

    def get(self, obj) -> tuple[bool, Any]:
        """(whether a value is kept for ``obj``, the value)."""
        known = self._entries.get(id(obj))
        return (True, known[1]) if known is not None and known[0] is obj else (False, None)

    def keep(self, obj, value):
        """Keep ``value`` for ``obj``; returns it. (The caller computes it: no callback, so that no module's code
        runs below this one's on the stack.)"""
        if len(self._entries) >= self._size:
            self._entries.pop(next(iter(self._entries)), None)
        self._entries[id(obj)] = (obj, value)
        return value


def source_of(jit) -> tuple[str, int]:
    """(the source Triton compiles for ``jit``, the file line it starts at). The function's file gives the lines;
    where its lines are not the kernel (a library replaced the source of a function it made from a template:
    triton_kernels' ``define_kernel``, ``JITFunction._unsafe_update_src``) or its file can no longer be read,
    ``jit.src`` is the kernel, and its lines are counted from its ``def``."""
    compiled = getattr(jit, "src", None)
    try:
        lines, first_line = inspect.getsourcelines(jit.fn)
    except OSError:
        if not isinstance(compiled, str):
            raise
        return textwrap.dedent(compiled), 1
    text = textwrap.dedent("".join(lines))
    if isinstance(compiled, str) and compiled.strip() not in text:
        return textwrap.dedent(compiled), 1
    return text, first_line


@dataclass(frozen=True)
class Source:
    """A JIT function's source, parsed. Shared by every reader of the function: never changed."""

    function: ast.FunctionDef
    line_offset: int  # the file line before its first

    @cached_property
    def params(self) -> tuple[str, ...]:
        return tuple(arg.arg for arg in self.function.args.args)

    @cached_property
    def local_names(self) -> frozenset:
        """The names the body binds itself (parameters, assignments, loop variables): they shadow globals and
        builtins (``input.to(...)`` is a tensor's method)."""
        return frozenset({*self.params, *(node.id for node in self.nodes() if isinstance(node, ast.Name)
                                          and isinstance(node.ctx, ast.Store))})

    def nodes(self) -> Iterator[ast.AST]:
        """Every node of the function but its decorators (the source Triton compiles has none), in ``ast.walk``'s
        order."""
        pending = deque([self.function.args, *self.function.body])
        if self.function.returns is not None:
            pending.append(self.function.returns)
        while pending:
            node = pending.popleft()
            pending.extend(ast.iter_child_nodes(node))
            yield node


#: Parsed sources, one per JIT function.
_parsed_so_far = ByIdentity(1024)


def parsed(jit) -> Source | None:
    """The parsed source of ``jit``, None when it is no function; read once per JIT function. Raises what reading or
    parsing the source raises."""
    kept, source = _parsed_so_far.get(jit)
    return source if kept else _parsed_so_far.keep(jit, _parse(jit))


def _parse(jit) -> Source | None:
    text, first_line = source_of(jit)
    function = ast.parse(text).body[0]
    return Source(function, first_line - 1) if isinstance(function, ast.FunctionDef) else None


@dataclass(frozen=True, eq=False)
class Scope:
    """One JIT function as a kernel reaches it: the kernel itself (no ``caller``), or a function that ``caller``
    calls, each parameter the call gives bound to the argument it passed (an expression in the caller's scope; a
    parameter left to its default is absent). A reader that keeps facts of its own per scope subclasses it: the
    scopes its calls reach are of the same class."""

    jit: Any
    source: Source
    caller: Scope | None = None
    passed: dict[str, ast.expr] = field(default_factory=dict)
    depth: int = 0  # calls below the kernel

    @classmethod
    def of(cls, jit) -> Scope | None:
        """The scope of ``jit`` as the kernel; None when its source is no function. Raises what reading it raises."""
        source = parsed(jit)
        return None if source is None else cls(jit, source)

    @property
    def name(self) -> str:
        return getattr(self.jit.fn, "__qualname__", "?")

    @property
    def defaults(self) -> dict:
        """The parameters that have a default, with it: what a call that leaves them out gives them."""
        return {param.name: param.default for param in getattr(self.jit, "params", ())
                if getattr(param, "has_default", False)}

    def resolve(self, node: ast.expr):
        """The object a name or attribute chain in the body stands for, as Triton resolves it (closure, then
        globals, then builtins); None when it is a local value, not a global object."""
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return getattr(base, node.attr, None) if base is not None else None
        if not isinstance(node, ast.Name) or node.id in self.source.local_names:
            return None
        fn = self.jit.fn
        closure = dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in (fn.__closure__ or ()))))
        if node.id in closure:
            return closure[node.id]
        if node.id in fn.__globals__:
            return fn.__globals__[node.id]
        return getattr(builtins, node.id, None)

    def callee(self, call: ast.Call) -> Scope | None:
        """The scope of the ``@triton.jit`` function ``call`` calls; None when it calls none, or one not followed
        (:meth:`enter`)."""
        target = self.resolve(call.func)
        return self.enter(target, call) if is_jit(target) else None

    def enter(self, jit, call: ast.Call) -> Scope | None:
        """The scope of ``jit`` as ``call`` in this scope calls it; None past :data:`MAX_DEPTH`, on a call back into
        a function already on the chain (a recursion), or when its source is no function. Raises what reading its
        source raises."""
        if self.depth >= MAX_DEPTH or any(scope.jit is jit for scope in self.chain()):
            return None
        source = parsed(jit)
        if source is None:
            return None
        passed = dict(zip(source.params, call.args))
        passed.update((keyword.arg, keyword.value) for keyword in call.keywords if keyword.arg in source.params)
        return replace(self, jit=jit, source=source, caller=self, passed=passed, depth=self.depth + 1)

    def chain(self) -> Iterator[Scope]:
        """This scope and its callers, up to the kernel."""
        scope: Scope | None = self
        while scope is not None:
            yield scope
            scope = scope.caller

    def reached(self) -> Iterator[Scope]:
        """This scope and the scope of every ``@triton.jit`` function its calls reach, at each call site."""
        pending = [self]
        while pending:
            scope = pending.pop()
            yield scope
            for node in scope.source.nodes():
                if isinstance(node, ast.Call) and (callee := scope.callee(node)) is not None:
                    pending.append(callee)


def is_jit(obj) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(obj, JITFunction)
