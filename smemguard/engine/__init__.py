"""The engine: what one ``install()`` builds (``engine.core.Engine``), and how it decides: the one guard around
its own steps, the candidates, the launch and compile-time recovery, torch.compile's, and wrappers' tiles.
Patches are handed the engine; they never import it."""
