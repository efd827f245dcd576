"""Smaller tiles registered as the alternatives of a library's kernel that is safe at any of them.

Shared by the packs whose kernel masks every tail and whose wrapper passes the grid as a function of the
meta-parameters (``vllm_prefix_prefill``, ``lmdeploy_flash_attention``): each names its kernel, wherever the
library's releases keep it, what its reading relied on and the tiles; the knowledge that makes them safe lives in
each pack's docstring. The alternatives are registered with :func:`smemguard.register_alternatives` when the module
is imported (each kernel once, only a kernel that has what the reading relied on); the engine tries them, largest
first, only for a launch whose grid is a function of the meta-parameters, and only once the launched tiles cannot
fit at any stage count.
"""

from __future__ import annotations

from ...kernels import registry
from .. import Kernels, Patch, Registration


class AlternativeTiles(Patch):
    """The kernel of ``kernels`` (:class:`smemguard.patches.Kernels`: wherever a release keeps it, where it has what
    the pack's argument reads) given the alternatives ``tiles`` (``((BLOCK_M, BLOCK_N), ...)``, largest first) at
    ``num_warps`` and ``num_stages``. ``name``, ``supported`` and ``checked`` are the patch's contract
    (:class:`smemguard.patches.Patch`); it registers only, so it applies in observe mode too (the engine records and
    re-raises there anyway)."""

    def __init__(self, name: str, *, supported, checked: tuple[str, ...], kernels: Kernels, tiles: tuple,
                 num_warps: int, num_stages: int):
        self._registration = Registration(registry.register_alternatives, registry.unregister_alternatives,
                                          registry.alternatives_for, self.memory)
        [self.kernel] = kernels.kernels
        super().__init__(name, target=self.kernel, kernels=kernels, supported=supported, checked=checked,
                         observe_safe=True, apply=self._register, remove=self._registration.clear,
                         present=self._present)
        self.tiles, self.num_warps, self.num_stages = tiles, num_warps, num_stages

    def alternatives(self) -> list:
        """The ``triton.Config`` of each tile, as registered."""
        import triton

        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=self.num_warps, num_stages=self.num_stages)
                for m, n in self.tiles]

    def _register(self, engine) -> None:
        for _, module in self.homes():
            self._registration.add(getattr(module, self.kernel), self.alternatives())

    def _present(self) -> bool:
        wanted = [{"BLOCK_M": m, "BLOCK_N": n} for m, n in self.tiles]
        return any([dict(config.kwargs) for config in registry.alternatives_for(getattr(module, self.kernel))] == wanted
                   for _, module in self.homes())
