"""ZeRO stage 3: parameters sharded between uses, gathered for each module
call as the native coordinator plans, released after it."""
