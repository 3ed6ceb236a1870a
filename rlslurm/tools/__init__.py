"""Tools an RL episode may call: their calls read from a model turn, their schemas, and the calls run bounded."""
