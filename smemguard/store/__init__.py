"""What smemguard keeps: the decision type and its actions, the decision cache other processes share, the
incident records (one declaration, one writer) and their Prometheus series."""
