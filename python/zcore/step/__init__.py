"""The optimizer step of ZeRO stages 0-3: flat units of parameters,
gradient reduction and gradient shards, the sharded and swapped optimizer,
the step that overlaps the next forward, and mixed precision."""
