"""Operations kit: heartbeat, watchdog, drain gate, env-diff, stack dumps, diag bundles."""
