"""Weight sync: disk, broadcast and IPC transports behind one DRAIN -> UPDATE -> VERIFY -> RESUME protocol."""
