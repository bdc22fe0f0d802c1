"""zcore inside a torch ``DeviceMesh``: DTensor parameters (tensor
parallelism), the mesh's data-parallel dimension, and pipeline stages."""
