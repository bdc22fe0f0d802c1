"""Collectives and who takes part in them: zcore's all-gathers,
reduce-scatters and broadcasts over ``torch.distributed``, the topology of
nodes and rank groups, and the quantized and compressed collectives of
ZeRO++ and 1-bit Adam."""
