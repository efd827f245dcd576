"""The ``smemguard`` command: ``commands`` parses and dispatches; one module per command beside it."""


def __getattr__(name):
    if name == "main":  # the console script of earlier releases named smemguard.cli:main
        from .commands import main

        return main
    raise AttributeError(f"module 'smemguard.cli' has no attribute {name!r}")
