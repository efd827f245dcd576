"""Reading a kernel's source: which parameters are pointers, and which integer parameters are the
innermost stride of a tensor (1 in a launch on contiguous tensors, which Triton compiles as a constant).

A pointer expression is a sum of a pointer and offsets, ``a_ptr + rm[:, None] * sam + rk[None, :] * sak``;
the walk follows it through local variables, ``+=`` updates, and the ``@triton.jit`` functions the
kernel calls (followed as :mod:`smemguard.kernels.source` follows calls: their parameters bound to what the
caller passed; their return values expanded). An
offset term is a *stride* term when it multiplies an integer parameter by a vector offset (one made
of ``tl.arange`` or broadcast with ``[:, None]``), a *unit* term when it is a vector offset alone (that
axis needs no stride argument).

The innermost stride of a pointer is told twice: by the tile layout (the stride multiplying the
last-axis offset, ``[None, :]``, or the only vector offset of a 1-D access) and by the argument
order (strides are passed outer to inner, ``*x.stride()``: the last of those the expression uses).
When both name the same argument it is *sure*; when they disagree (a tile loaded transposed, a
column loaded along its rows), it is *unsure*, and the check compiles each reading, and the launch
with neither equal to 1. A unit term on the last axis settles the pointer (its innermost stride is
not an argument); a scalar access (no vector offset) is not vectorized and tells nothing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator

from ..kernels.source import Scope, parsed

#: Calls whose first argument (or ``pointer=``/``base=``) is a pointer expression.
POINTER_CALLS = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min",
                 "atomic_and", "atomic_or", "atomic_xor", "make_block_ptr", "make_tensor_descriptor"}

Axis = tuple[int, int]  # (position, rank) of a broadcast offset: rk[None, :] is (1, 2)


class _Scope(Scope):
    """A JIT function as the kernel reaches it (:class:`smemguard.kernels.source.Scope`), with the values its
    names are given and the values it returns."""

    @cached_property
    def definitions(self) -> dict[str, list[ast.AST]]:
        """x = v and x += v: x -> [v, ...]."""
        found: dict[str, list[ast.AST]] = {}
        for node in self.source.nodes():
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found.setdefault(target.id, []).append(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                found.setdefault(node.target.id, []).append(node.value)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                # x += v adds the term v to what x holds; x *= v makes x a product
                additive = isinstance(node.op, (ast.Add, ast.Sub))
                value = node.value if additive else ast.BinOp(ast.Name(node.target.id, ast.Load()), node.op, node.value)
                found.setdefault(node.target.id, []).append(value)
        return found

    @cached_property
    def returns(self) -> list[ast.AST]:
        return [node.value for node in self.source.nodes() if isinstance(node, ast.Return) and node.value is not None]

    def is_kernel_parameter(self, name: str) -> bool:
        return self.caller is None and name in self.jit.arg_names

    def meanings(self, name: str) -> list[tuple[ast.AST, "_Scope"]]:
        """What ``name`` stands for: the caller's argument for a parameter, and every value assigned to it."""
        found = [(self.passed[name], self.caller)] if name in self.passed else []
        return found + [(value, self) for value in self.definitions.get(name, ())]


def returns_a_value(jit) -> bool:
    """Whether the body of ``jit`` (not of functions defined in it) returns a value; False when its source
    cannot be read (then its compile says what it is)."""
    try:
        source = parsed(jit)
    except Exception:
        return False
    pending = list(source.function.body) if source is not None else []
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Return) and node.value is not None:
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))
    return False


def calls(jit) -> set[str]:
    """The names of the functions ``jit``'s source calls (``helper(...)``, ``module.helper(...)``); empty when its
    source cannot be read."""
    try:
        source = parsed(jit)
    except Exception:
        return set()
    nodes = source.nodes() if source is not None else ()
    return {_called_name(node) for node in nodes if isinstance(node, ast.Call)}


def _called_name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def _scopes(jit) -> Iterator[_Scope]:
    """The kernel's scope and those of every ``@triton.jit`` function it calls, at each call site."""
    kernel = _Scope.of(jit)
    return kernel.reached() if kernel is not None else iter(())


def _pointer_expressions(scope: _Scope) -> Iterator[ast.AST]:
    for node in scope.source.nodes():
        if isinstance(node, ast.Call) and _called_name(node) in POINTER_CALLS:
            yield from node.args[:1]
            yield from (kw.value for kw in node.keywords if kw.arg in ("pointer", "base"))


def _broadcast_axis(index: ast.AST) -> Axis | None:
    """``[:, None]`` -> (0, 2): the position of the one full slice among ``None``s, and the rank."""
    entries = index.elts if isinstance(index, ast.Tuple) else [index]
    slices = [i for i, entry in enumerate(entries) if isinstance(entry, ast.Slice)
              and entry.lower is None and entry.upper is None and entry.step is None]
    nones = [entry for entry in entries if isinstance(entry, ast.Constant) and entry.value is None]
    if len(slices) == 1 and len(slices) + len(nones) == len(entries) and nones:
        return slices[0], len(entries)
    return None


@dataclass(frozen=True)
class _Term:
    node: ast.AST
    scope: _Scope
    axis: Axis | None


def _summands(node: ast.AST, scope: _Scope, axis: Axis | None, seen: set) -> list[_Term]:
    """The terms of a sum, through locals, callee parameters and the return values of called JIT functions."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        return _summands(node.left, scope, axis, seen) + _summands(node.right, scope, axis, seen)
    if isinstance(node, ast.Subscript):
        inner = _broadcast_axis(node.slice)
        if inner is not None:
            return _summands(node.value, scope, inner, seen)
    if isinstance(node, ast.Name):
        meanings = scope.meanings(node.id)
        terms = [_Term(node, scope, axis)] if scope.is_kernel_parameter(node.id) or not meanings else []
        for value, where in meanings:
            if (id(value), id(where)) not in seen:
                seen.add((id(value), id(where)))
                terms += _summands(value, where, axis, seen)
        return terms
    if isinstance(node, ast.Call) and (callee := scope.callee(node)) is not None and callee.returns:
        return [term for value in callee.returns for term in _summands(value, callee, axis, seen)]
    return [_Term(node, scope, axis)]


def _factors(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _factors(node.left) + _factors(node.right)
    return [node]


def _parameter_behind(node: ast.AST, scope: _Scope, seen: frozenset = frozenset()) -> str | None:
    """The kernel parameter ``node`` is, through aliases, callee parameters and ``.to()`` casts
    (a parameter the kernel updates, ``X += row * stride``, is still that parameter)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "cast"):
        return _parameter_behind(node.func.value, scope, seen)
    if not isinstance(node, ast.Name) or (id(node), id(scope)) in seen:
        return None
    if scope.is_kernel_parameter(node.id):
        return node.id
    behind = {_parameter_behind(value, where, seen | {(id(node), id(scope))})
              for value, where in scope.meanings(node.id)}
    return behind.pop() if len(behind) == 1 else None


def _is_vector(node: ast.AST, scope: _Scope, seen: set) -> bool:
    """Whether ``node`` is a block of offsets: made of ``tl.arange`` or broadcast with ``None``."""
    for part in ast.walk(node):
        if isinstance(part, ast.Call) and _called_name(part) == "arange":
            return True
        if isinstance(part, ast.Call) and (callee := scope.callee(part)) is not None \
                and any(_is_vector(value, callee, seen) for value in callee.returns):
            return True
        if isinstance(part, ast.Subscript) and _broadcast_axis(part.slice) is not None:
            return True
        if isinstance(part, ast.Name):
            for value, where in scope.meanings(part.id):
                if (id(value), id(where)) not in seen:
                    seen.add((id(value), id(where)))
                    if _is_vector(value, where, seen):
                        return True
    return False


def _axis(node: ast.AST, scope: _Scope, seen: set) -> Axis | None:
    """The broadcast axis of an offset: ``rk[None, :]``, ``(k + rk)[None, :]``, a local holding one."""
    if isinstance(node, ast.Subscript) and (axis := _broadcast_axis(node.slice)) is not None:
        return axis
    if isinstance(node, ast.Name):
        for value, where in scope.meanings(node.id):
            if (id(value), id(where)) not in seen:
                seen.add((id(value), id(where)))
                if (axis := _axis(value, where, seen)) is not None:
                    return axis
        return None
    children = {ast.BinOp: lambda n: [n.left, n.right], ast.UnaryOp: lambda n: [n.operand],
                ast.Call: lambda n: [*n.args, *([n.func.value] if isinstance(n.func, ast.Attribute) else [])]
                }.get(type(node))
    for child in children(node) if children else ():
        if (axis := _axis(child, scope, seen)) is not None:
            return axis
    return None


def pointer_parameters(jit) -> set[str]:
    """Parameters the kernel loads from or stores to, read from its source (and its callees').

    The names found among the *terms* of the sums reaching ``tl.load``/``tl.store`` are the
    pointers (offsets are products, ``rm * stride_am``, or locals made of them). Also counted:
    parameters whose ``.dtype`` or ``.type`` is read, and names ending in ``ptr``.
    """
    found = {name for name in jit.arg_names if name.lower().endswith("ptr")}
    for scope in _scopes(jit):
        for expression in _pointer_expressions(scope):
            found.update(term.node.id for term in _summands(expression, scope, None, set())
                         if isinstance(term.node, ast.Name) and term.scope.is_kernel_parameter(term.node.id))
        found.update(_parameter_behind(node.value, scope) or "" for node in scope.source.nodes()
                     if isinstance(node, ast.Attribute) and node.attr in ("dtype", "type"))
    return found & set(jit.arg_names)


@dataclass
class UnitStrides:
    """The innermost strides of the kernel's tensors: ``sure`` ones (tile layout and argument order
    agree), and for the others both readings: ``by_order`` (the last of each tensor's strides in
    argument order) and ``by_layout`` (the stride on the tile's last axis; the order's where it does
    not show)."""

    sure: set[str] = field(default_factory=set)
    by_order: set[str] = field(default_factory=set)
    by_layout: set[str] = field(default_factory=set)

    def judge(self, layout: set[str], last: str | None) -> None:
        if last is None:
            return
        if layout == {last}:
            self.sure.add(last)
        else:
            self.by_order.add(last)
            self.by_layout |= layout or {last}

    @property
    def unsure(self) -> set[str]:
        return self.by_order | self.by_layout


def unit_strides(jit, pointers: set[str], integers: set[str]) -> UnitStrides:
    """Which of ``integers`` are the innermost stride of the tensors at ``pointers`` (see the module)."""
    order = {name: index for index, name in enumerate(jit.arg_names)}
    found = UnitStrides()
    for scope in _scopes(jit):
        for expression in _pointer_expressions(scope):
            _judge_expression(expression, scope, pointers, integers, order, found)
        for node in scope.source.nodes():
            if isinstance(node, ast.Call) and _called_name(node) in ("make_block_ptr", "make_tensor_descriptor"):
                _judge_descriptor(node, scope, integers, found)
    found.by_order -= found.sure
    found.by_layout -= found.sure
    return found


def _judge_expression(expression: ast.AST, scope: _Scope, pointers: set[str], integers: set[str],
                      order: dict[str, int], found: UnitStrides) -> None:
    terms = _summands(expression, scope, None, set())
    if not any(isinstance(t.node, ast.Name) and t.scope.is_kernel_parameter(t.node.id) and t.node.id in pointers
               for t in terms):
        return
    vector_terms: list[tuple[list[str], Axis | None]] = []  # (strides, axis) of each vector offset
    every_stride: set[str] = set()  # also those of scalar offsets: a batch stride, a column's stride
    for term in terms:
        if isinstance(term.node, ast.Name) and term.scope.is_kernel_parameter(term.node.id):
            continue  # the pointer, or a scalar offset passed as it is
        factors = _factors(term.node)
        strides = [p for f in factors if (p := _parameter_behind(f, term.scope)) in integers]
        offsets = [f for f in factors if _parameter_behind(f, term.scope) not in integers]
        if offsets and any(_is_vector(f, term.scope, set()) for f in offsets):
            axis = term.axis or next((a for f in offsets if (a := _axis(f, term.scope, set())) is not None), None)
            vector_terms.append((strides, axis))
            every_stride.update(strides)
        elif len(strides) == 1:  # t * stride_t; of t_len * stride_t, which is the stride is not told
            every_stride.update(strides)
    if not vector_terms:
        return  # a scalar access: nothing to vectorize
    if all(axis is None for _, axis in vector_terms):  # a 1-D access: every offset on the one axis
        if any(not strides for strides, _ in vector_terms):
            return  # x + row * stride_row + col: the innermost axis is addressed without a stride argument
        # one stride for the axis (a local assigned in two branches adds its terms twice), or unknown
        strides_seen = {frozenset(strides) for strides, _ in vector_terms}
        by_layout = set(strides_seen.pop()) if len(strides_seen) == 1 else set()
    else:
        def on_last_axis(axis: Axis | None) -> bool:
            return axis is not None and axis[0] == axis[1] - 1

        if any(not strides and on_last_axis(axis) for strides, axis in vector_terms):
            return  # x + rm[:, None] * stride_xm + rn[None, :]: likewise
        by_layout = {p for strides, axis in vector_terms if on_last_axis(axis) for p in strides}
    found.judge(by_layout, max(every_stride, key=order.__getitem__) if every_stride else None)


def _judge_descriptor(call: ast.Call, scope: _Scope, integers: set[str], found: UnitStrides) -> None:
    """``make_block_ptr(base, shape, strides, offsets, block_shape, order)``: the fastest dimension is
    ``order[0]``; a tensor descriptor's last stride must be 1 (Triton rejects others)."""
    keywords = {kw.arg: kw.value for kw in call.keywords}
    strides = keywords.get("strides", call.args[2] if len(call.args) > 2 else None)
    if not isinstance(strides, (ast.Tuple, ast.List)) or not strides.elts:
        return
    names = [_parameter_behind(entry, scope) for entry in strides.elts]
    fastest = len(names) - 1
    if _called_name(call) == "make_block_ptr":
        dims = keywords.get("order", call.args[5] if len(call.args) > 5 else None)
        known = isinstance(dims, (ast.Tuple, ast.List)) and dims.elts and isinstance(dims.elts[0], ast.Constant) \
            and isinstance(dims.elts[0].value, int) and 0 <= dims.elts[0].value < len(names)
        if not known:
            found.judge(set(), names[fastest] if names[fastest] in integers else None)
            return
        fastest = dims.elts[0].value
    if names[fastest] in integers:
        found.judge({names[fastest]}, names[fastest])
