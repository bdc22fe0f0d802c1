"""Host memory, arenas and NVMe: where bytes live and how they move.

Pinned and page-aligned host memory, the contiguous arena, staging buffers,
the asynchronous I/O engine and the swap manager, each over its native
component in ``zcore._C``."""
