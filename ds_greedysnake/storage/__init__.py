"""Where the bytes live and how they move: the SSD store and its layout, host<->device transfers, the host
memory shared with the optimizer worker, checkpoints, the I/O trace. Imports only the top-level base."""
