"""Per-unit levers on memory and speed: activation checkpointing and offload, tiled MLP, compiled units."""
