"""The per-layer Adam update on SSD- or host-resident states, inline or in the worker process (runtime's
LayerwiseAdam decides the step and submits these). Imports storage/ and the top-level base only."""
