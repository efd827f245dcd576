"""Smaller tiles registered as the alternatives of a library's kernel that is safe at any of them.

Shared by the packs whose kernel masks every tail and whose wrapper passes the grid as a function of the
meta-parameters (``vllm_prefix_prefill``, ``lmdeploy_flash_attention``): each names its module, its kernel, the
parameters its reading relied on and the tiles; the knowledge that makes them safe lives in each pack's docstring.
The alternatives are registered with :func:`smemguard.register_alternatives` when the module is imported (each
kernel once, only a kernel with those parameters); the engine tries them, largest first, only for a launch whose
grid is a function of the meta-parameters, and only once the launched tiles cannot fit at any stage count.
"""

from __future__ import annotations

import sys

from ..kernels import registry
from . import Patch, Registration


class AlternativeTiles(Patch):
    """``module.kernel`` given the alternatives ``tiles`` (``((BLOCK_M, BLOCK_N), ...)``, largest first) at
    ``num_warps`` and ``num_stages``, when it has ``params``. ``library``: how messages name the release read
    (``"vLLM"``). ``name``, ``supported`` and ``checked`` are the patch's contract (:class:`smemguard.patches.Patch`);
    it registers only, so it applies in observe mode too (the engine records and re-raises there anyway)."""

    def __init__(self, name: str, *, supported, checked: tuple[str, ...], module: str, kernel: str,
                 params: frozenset, tiles: tuple, num_warps: int, num_stages: int, library: str):
        self._registration = Registration(registry.register_alternatives, registry.unregister_alternatives,
                                          registry.alternatives_for)
        super().__init__(name, target=f"{module}.{kernel}", modules=(module,), supported=supported, checked=checked,
                         observe_safe=True, apply=self._register, remove=self._registration.clear,
                         present=self._present)
        self.module, self.kernel, self.params, self.tiles = module, kernel, params, tiles
        self.num_warps, self.num_stages, self._library = num_warps, num_stages, library

    def alternatives(self) -> list:
        """The ``triton.Config`` of each tile, as registered."""
        import triton

        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=self.num_warps, num_stages=self.num_stages)
                for m, n in self.tiles]

    def _imported_kernel(self):
        kernel = getattr(sys.modules.get(self.module), self.kernel, None)
        return kernel if hasattr(kernel, "arg_names") else None  # builds without a usable Triton: a plain function

    def _register(self, engine) -> None:
        kernel = self._imported_kernel()
        if kernel is not None:
            self._registration.add(f"{self.module}.{self.kernel}", kernel, self.params, self.alternatives(),
                                   checked=f"{self._library} {self.checked[-1]}")

    def _present(self) -> bool:
        kernel = self._imported_kernel()
        registered = registry.alternatives_for(kernel) if kernel is not None else ()
        return [dict(config.kwargs) for config in registered] == [{"BLOCK_M": m, "BLOCK_N": n} for m, n in self.tiles]
