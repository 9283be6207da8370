"""The model's weights: FSDP2 units, sharded loading, seeded init, rotary scaling."""
