"""What each constexpr parameter of a kernel does to its software pipeline, read from its source.

A kernel may write its pipeline depth itself: ``for k in tl.range(0, n, num_stages=NUM_STAGES)``
pipelines that loop with ``NUM_STAGES`` stages whatever the launch option says, so lowering the
option alone changes no byte. :func:`knobs_of` reads the kernel's body and the bodies of the
``@triton.jit`` functions it calls (followed as :mod:`.source` follows calls: through the kernel's
globals and closure, as Triton resolves them) and gives each parameter one role:

* :data:`PIPELINE_DEPTH`: only ever a loop's ``num_stages=`` (possibly through a called jit
  function's parameter). Lowering it changes which loads are in flight, not the arithmetic: it
  is lowered together with the ``num_stages`` launch option (:meth:`Knobs.lowered_with`);
* :data:`WARP_COUNT`: only passed on as ``num_warps=``; lowered together with ``num_warps``;
* :data:`UNUSED`: not read at all (Liger-Kernel's ``num_warps`` parameter): changing it changes nothing;
* :data:`OTHER`: anything else (arithmetic, shapes, masks, branches, stored values, a call smemguard
  cannot read): never changed.

Apart from its role, a parameter may size a block (:attr:`Knobs.shapes`: it appears in ``tl.arange``'s bounds or in
a block's shape, ``tl.zeros``, ``tl.full``, ``tl.reshape``, ``tl.broadcast_to``, ``tl.make_block_ptr``'s and
``tl.make_tensor_descriptor``'s ``block_shape``, here or in a called jit function): those are the tiles a
wrapper chose, which a record names when it leaves them to the caller (a stride passed as a constexpr is not one).

It also lists the loops whose ``num_stages=`` is a literal or computed in the body: those keep their
depth whatever recovery does. When no loop follows the option or a pipeline-depth parameter,
fewer stages cannot lower the bytes (:meth:`Knobs.stages_futile`), and no candidate is compiled to
find that out. A kernel whose source cannot be read gets no roles and no verdict: recovery then
measures as it always did.

Read once per JIT function (cached); nothing here runs on the launch path.
"""

from __future__ import annotations

import ast
import builtins
import logging
from dataclasses import dataclass, field

from .source import ByIdentity, Scope, is_jit, parsed

log = logging.getLogger(__name__)

PIPELINE_DEPTH = "pipeline depth"
WARP_COUNT = "warp count"
UNUSED = "unused"
OTHER = "other use"

#: The launch option each role follows.
OPTION_OF = {PIPELINE_DEPTH: "num_stages", WARP_COUNT: "num_warps"}

#: Where ``tl.range(start, end, step, num_stages, ...)`` takes ``num_stages`` positionally.
_RANGE_STAGES_POSITION = 3


@dataclass(frozen=True)
class FixedLoop:
    """A pipelined loop whose depth neither the launch option nor a pipeline-depth parameter sets."""

    function: str  # the jit function it is in
    line: int  # its line in that function's file
    num_stages: str  # as written: "3", "NUM_STAGES - 1", or the argument a caller passed for it

    def text(self) -> str:
        return f"{self.function} line {self.line}: num_stages={self.num_stages}"


@dataclass(frozen=True)
class Knobs:
    """The roles of a kernel's parameters and what its loops follow."""

    roles: dict = field(default_factory=dict)  # parameter name -> role
    following_loops: int = 0  # loops pipelined by the launch option or by a pipeline-depth parameter
    fixed_loops: tuple = ()  # FixedLoop
    complete: bool = False  # every call and loop of the kernel was read
    shapes: tuple = ()  # parameters that size a block (the tiles), in the order of the parameters

    def with_role(self, role: str) -> list[str]:
        return [name for name, found in self.roles.items() if found == role]

    def stages_futile(self) -> str | None:
        """Why fewer stages cannot lower this kernel's shared memory, or None when they may."""
        if not self.complete or self.following_loops:
            return None
        if not self.fixed_loops:
            return "the kernel has no loop to pipeline, so stages change no byte"
        return f"every pipelined loop sets its own num_stages ({self.fixed_text()}), so fewer stages change no byte"

    def writes_depth(self) -> bool:
        """Whether some loop's depth is not the launch option's: a pipeline-depth parameter or a fixed
        ``num_stages=`` (then a calibrated estimate, which reads the option, does not apply)."""
        return bool(self.fixed_loops or self.with_role(PIPELINE_DEPTH))

    def fixed_text(self) -> str:
        return "; ".join(loop.text() for loop in self.fixed_loops)

    def lowered_with(self, options: dict, named: dict) -> dict:
        """The parameters that follow the launch ``options`` ({"num_stages": 2}), lowered with them:
        a pipeline-depth or warp-count parameter to at most the option's new value. A parameter
        named like the option (the keyword sets both) must not be used otherwise:
        :class:`OptionIsAParameter` when it is."""
        lowered = {}
        for option, value in options.items():
            # A namesake parameter whose use could not be read counts as used.
            role_of_namesake = self.roles.get(option, OTHER if option in named else None)
            if role_of_namesake is not None and role_of_namesake not in (UNUSED, _role_for(option)):
                raise OptionIsAParameter(f"{option} is also a parameter the kernel uses: changing the launch "
                                         "option would change it too")
            for name in self.with_role(_role_for(option)):
                current = named.get(name)
                if name != option and is_count(current) and is_count(value) and current > value:
                    lowered[name] = value
        return lowered

    def depth(self, named: dict) -> int:
        """The deepest pipeline a pipeline-depth parameter asks for (0 when none does)."""
        return max((named[name] for name in self.with_role(PIPELINE_DEPTH) if is_count(named.get(name))), default=0)


def lowered_constexprs(jit, constexprs: dict, options: dict) -> dict:
    """Triton's packed constexprs (``{(parameter index,): value}``, as ``JITFunction._do_compile`` gets
    them) with the parameters that follow launch ``options`` lowered with them."""
    names = {(index,): param.name for index, param in enumerate(jit.params)}
    named = {names[path]: value for path, value in constexprs.items() if path in names}
    lowered = knobs_of(jit).lowered_with(options, named)
    return {path: lowered.get(names.get(path), value) for path, value in constexprs.items()}


class OptionIsAParameter(Exception):
    """A launch option that shares its name with a parameter the kernel itself uses."""


def _role_for(option: str) -> str | None:
    return next((role for role, name in OPTION_OF.items() if name == option), None)


def is_count(value) -> bool:
    """A stage or warp count: a positive int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


#: Knobs read so far, one per JIT function.
_read_so_far = ByIdentity(1024)


def program_tiles(jit) -> frozenset | None:
    """The parameters the kernel's program ids step over (``pid_m * BLOCK_M``, with ``pid_m`` computed from
    ``tl.program_id`` directly or through other names, a loop over them, a call given them): the tiles its grid must
    be computed from, since a smaller one leaves programs out. A product with a value that was divided by the same
    parameter is a rounding, not a step (``(start_m * BLOCK_M) // BLOCK_N * BLOCK_N``, a loop's bound). In the kernel's
    own body (a product inside a function it calls is not seen); None when its source cannot be read."""
    try:
        source = parsed(jit)
    except Exception:  # an unreadable source: nothing known
        return None
    if source is None:
        return None
    parameters = set(source.params)
    divided: dict[str, set[str]] = {}  # a name computed from a program id -> the parameters it was divided by

    def from_programs(node: ast.AST) -> set[str] | None:
        """The parameters a value computed from a program id was divided by on its way to ``node``; None when
        ``node`` is not computed from a program id."""
        if isinstance(node, ast.Call) and _called_attribute(node) in _LOADS:
            return None  # what is loaded is data, not where a program is
        if isinstance(node, ast.Call) and _called_attribute(node) == "program_id":
            return set()
        if isinstance(node, ast.Name):
            return set(divided[node.id]) if node.id in divided else None
        divisor = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Div)):
            divisor = node.right
        elif isinstance(node, ast.Call) and _called_attribute(node) == "cdiv" and len(node.args) == 2:
            divisor = node.args[1]
        found = [divisors for child in ast.iter_child_nodes(node) if (divisors := from_programs(child)) is not None]
        if not found:
            return None
        divisors = set().union(*found)
        if isinstance(divisor, ast.Name) and divisor.id in parameters:
            divisors.add(divisor.id)
        return divisors

    bindings = [(node.iter if isinstance(node, ast.For) else node.value,
                 node.targets if isinstance(node, ast.Assign) else [node.target])
                for node in source.nodes() if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For))
                and (node.iter if isinstance(node, ast.For) else node.value) is not None]
    grown = True
    while grown:  # a name computed from one computed from a program id, to any depth
        grown = False
        for value, targets in bindings:
            divisors = from_programs(value)
            if divisors is None:
                continue
            for name in (node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)):
                if name not in divided or not divisors <= divided[name]:
                    divided[name] = divided.get(name, set()) | divisors
                    grown = True
    tiles = set()
    for node in source.nodes():
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for one, other in ((node.left, node.right), (node.right, node.left)):
                divisors = from_programs(other) if isinstance(one, ast.Name) and one.id in parameters else None
                if divisors is not None and one.id not in divisors:
                    tiles.add(one.id)
    return frozenset(tiles)


#: Calls whose result is data read from memory (a value, not an index).
_LOADS = frozenset({"load", "atomic_add", "atomic_max", "atomic_min", "atomic_cas", "atomic_xchg"})


def _called_attribute(call: ast.Call) -> str | None:
    """``program_id`` of ``tl.program_id(0)`` (or of ``program_id(0)``)."""
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else function.id if isinstance(function, ast.Name) \
        else None


def knobs_of(jit) -> Knobs:
    """The :class:`Knobs` of a JIT function; no roles when its source cannot be read. Read once per function."""
    kept, knobs = _read_so_far.get(jit)
    return knobs if kept else _read_so_far.keep(jit, _knobs_of(jit))


def _knobs_of(jit) -> Knobs:
    try:
        kernel = Scope.of(jit)
        facts = _read(kernel) if kernel is not None else None
    except Exception:  # an unreadable kernel is measured, never guessed about
        log.debug("smemguard: cannot read the parameters of %s", getattr(jit, "__name__", jit), exc_info=True)
        return Knobs()
    if facts is None:
        return Knobs()
    roles = {name: _role(facts.uses.get(name, [])) for name in facts.params}
    following, fixed = 0, []
    for loop in facts.loops:
        if loop.kind == _OPTION or (loop.kind == _PARAMETER and roles.get(loop.detail) == PIPELINE_DEPTH):
            following += 1
        else:
            used_otherwise = " (a parameter with other uses, never changed)" if loop.kind == _PARAMETER else ""
            fixed.append(FixedLoop(loop.function, loop.line, loop.detail + used_otherwise))
    shapes = tuple(name for name in facts.params if name in facts.shapes)
    return Knobs(roles, following, tuple(fixed), facts.complete, shapes)


# -- Reading one jit function -----------------------------------------------------------------

# Loop kinds: follows the launch option; follows a parameter of the function; fixed.
_OPTION, _PARAMETER, _FIXED = "option", "parameter", "fixed"
# Use kinds of a parameter: a loop's num_stages, passed on as num_warps, anything else.
_DEPTH_USE, _WARP_USE, _OTHER_USE = PIPELINE_DEPTH, WARP_COUNT, OTHER


@dataclass(frozen=True)
class _Loop:
    kind: str
    detail: str  # the parameter (_PARAMETER) or the text of num_stages (_FIXED)
    function: str
    line: int


@dataclass
class _Facts:
    params: tuple
    uses: dict  # parameter -> [use kinds]
    loops: list  # _Loop, in terms of this function's parameters
    complete: bool = True
    shapes: set = field(default_factory=set)  # parameters that size a block


def _role(uses: list) -> str:
    if not uses:
        return UNUSED
    kinds = set(uses)
    return kinds.pop() if len(kinds) == 1 and kinds <= {_DEPTH_USE, _WARP_USE} else OTHER


def _read(scope: Scope) -> _Facts:
    reader = _Reader(scope)
    for statement in scope.source.function.body:
        reader.visit(statement)
    return reader.facts


class _Reader(ast.NodeVisitor):
    """One pass over a function body: every read of a parameter, every loop, every call."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.name = scope.name
        self.line_offset = scope.source.line_offset
        self.facts = _Facts(scope.source.params, {name: [] for name in scope.source.params}, [])
        self.handled: set[int] = set()  # ids of Name nodes whose use a call or loop already classified

    def use(self, name: str, kind: str) -> None:
        self.facts.uses[name].append(kind)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.facts.uses and id(node) not in self.handled:
            self.use(node.id, _OTHER_USE)  # also a Store: a parameter assigned in the body is not a pure knob

    def visit_FunctionDef(self, node) -> None:
        self.facts.complete = False  # a nested function: not what Triton compiles, not read here
        self.generic_visit(node)

    visit_Lambda = visit_FunctionDef

    def visit_For(self, node: ast.For) -> None:
        if isinstance(node.iter, ast.Call):
            callee = self.scope.resolve(node.iter.func)
            if _is_triton_range(callee):
                self.facts.loops.append(self.range_loop(node.iter))
            elif callee is builtins.range:
                self.facts.loops.append(_Loop(_OPTION, "", self.name, self.line_offset + node.lineno))
        self.generic_visit(node)

    def range_loop(self, call: ast.Call) -> _Loop:
        line = self.line_offset + call.lineno
        stages = next((k.value for k in call.keywords if k.arg == "num_stages"), None)
        if stages is None and len(call.args) > _RANGE_STAGES_POSITION:
            stages = call.args[_RANGE_STAGES_POSITION]
        if stages is None or (isinstance(stages, ast.Constant) and stages.value is None):
            return _Loop(_OPTION, "", self.name, line)
        if isinstance(stages, ast.Name) and stages.id in self.facts.uses:
            self.handled.add(id(stages))
            self.use(stages.id, _DEPTH_USE)
            return _Loop(_PARAMETER, stages.id, self.name, line)
        return _Loop(_FIXED, ast.unparse(stages), self.name, line)

    def visit_Call(self, node: ast.Call) -> None:
        callee = self.scope.resolve(node.func)
        for sizing in block_shape_arguments(callee, node):
            self.facts.shapes |= self.parameters_in(sizing)
        if is_jit(callee):
            self.call_jit(node, callee)
        elif not (_is_triton_range(callee) or _is_library(callee) or _is_method_of_a_value(node.func, self.scope)):
            self.facts.complete = False  # it may hide a loop; a parameter passed to it is "other use"
        for keyword in node.keywords:
            if keyword.arg == "num_warps" and isinstance(keyword.value, ast.Name) \
                    and keyword.value.id in self.facts.uses and not is_jit(callee):
                self.handled.add(id(keyword.value))
                self.use(keyword.value.id, _WARP_USE)
        self.generic_visit(node)

    def parameters_in(self, node: ast.expr) -> set:
        """This function's parameters read anywhere in ``node`` (``BLOCK_M // 2``, ``(BLOCK_M, BLOCK_N)``)."""
        return {name.id for name in ast.walk(node) if isinstance(name, ast.Name) and name.id in self.facts.uses}

    def call_jit(self, node: ast.Call, callee) -> None:
        """What the callee does with each parameter of ours passed to it, and its loops in our terms."""
        entered = self.scope.enter(callee, node)
        if entered is None:
            self.facts.complete = False
            return
        facts = _read(entered)
        self.facts.complete &= facts.complete
        passed = entered.passed
        roles = {name: _role(facts.uses.get(name, [])) for name in facts.params}
        for name in facts.shapes & passed.keys():
            self.facts.shapes |= self.parameters_in(passed[name])
        for name, value in passed.items():
            if isinstance(value, ast.Name) and value.id in self.facts.uses:
                self.handled.add(id(value))
                if roles[name] == UNUSED and name in OPTION_OF.values():  # Liger's way: passed on as the option
                    self.use(value.id, _role_for(name))
                elif roles[name] != UNUSED:
                    self.use(value.id, roles[name] if roles[name] in (_DEPTH_USE, _WARP_USE) else _OTHER_USE)
        defaults = entered.defaults
        for loop in facts.loops:
            if loop.kind != _PARAMETER:
                self.facts.loops.append(loop)
                continue
            value = passed.get(loop.detail)
            if isinstance(value, ast.Name) and value.id in self.facts.uses:
                self.facts.loops.append(_Loop(_PARAMETER, value.id, loop.function, loop.line))
            else:
                text = ast.unparse(value) if value is not None else repr(defaults.get(loop.detail))
                self.facts.loops.append(_Loop(_FIXED, text, loop.function, loop.line))


#: Triton's functions that take a block's shape: the positions and keyword of the arguments that give it (None: every
#: positional argument, ``tl.arange``'s bounds).
_BLOCK_SHAPES = {"arange": (None, None), "zeros": ((0,), "shape"), "full": ((0,), "shape"),
                 "reshape": ((1,), "shape"), "broadcast_to": ((1,), "shape"), "make_block_ptr": ((4,), "block_shape"),
                 "make_tensor_descriptor": ((3,), "block_shape")}


def block_shape_arguments(callee, call: ast.Call) -> list:
    """The arguments of ``call`` that give a block's shape, when ``callee`` is one of :data:`_BLOCK_SHAPES`."""
    import triton.language as tl

    name = next((name for name in _BLOCK_SHAPES if callee is not None and getattr(tl, name, None) is callee), None)
    if name is None:
        return []
    positions, keyword = _BLOCK_SHAPES[name]
    found = list(call.args) if positions is None else [call.args[i] for i in positions if i < len(call.args)]
    return found + [item.value for item in call.keywords if item.arg == keyword]


def _is_triton_range(obj) -> bool:
    import triton.language as tl

    return obj is tl.range


def _is_library(obj) -> bool:
    """Triton's own language functions, ``constexpr_function``s (run while compiling) and Python's
    builtins: they hold no pipelined loop."""
    if obj is None:
        return False
    modules = (getattr(obj, "__module__", None) or "", type(obj).__module__)
    return "builtins" in modules or any(module == "triton" or module.startswith("triton.") for module in modules)


def _is_method_of_a_value(func: ast.expr, scope: Scope) -> bool:
    """``acc.to(tl.float16)``: a method of a value computed in the body (a tensor), not of a global."""
    if not isinstance(func, ast.Attribute):
        return False
    while isinstance(func, ast.Attribute):
        func = func.value
    return not isinstance(func, ast.Name) or scope.resolve(func) is None
