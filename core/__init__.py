"""What every command shares: config, distributed setup, checkpoints, logging, errors, the CLI."""
