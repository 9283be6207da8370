"""The user's commands: one file per command, and the `weft` parser that dispatches to them."""
