"""lex-gpt's plumbing: checkpoints, one-line errors, devices and DDP, run directories, outputs,
data."""
