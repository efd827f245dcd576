"""Facts: smemguard's version checks, the settings (the one reader of the environment), the GPU table, facts of
the running process, files and untrusted input. Imports nothing of smemguard's above it."""
