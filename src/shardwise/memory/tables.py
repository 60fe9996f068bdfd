"""The names the memory estimates know (strategies, precisions, optimizers), torch-free so that
`shardwise plan --help` can list them without importing torch."""

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
PRECISIONS = ("fp32", "bf16", "mixed")

# optimizer name -> (bytes of state per parameter element in fp32, bytes of per-tensor state)
OPTIMIZER_STATE = {
    "adamw": (8, 4),  # exp_avg, exp_avg_sq; a float32 `step` tensor per parameter
    "adam": (8, 4),
    "sgd-momentum": (4, 0),  # momentum_buffer
    "sgd": (0, 0),
    "adagrad": (4, 4),  # sum; step
}
